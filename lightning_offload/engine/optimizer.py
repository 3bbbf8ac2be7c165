"""The offload engine as a ``torch.optim.Optimizer``: :class:`OffloadOptimizer` takes over a user's Adam/AdamW (or any
optimizer a host rule steps), builds one slot per offloaded tensor and the lanes they share, and hands each step to
the orchestrator (:class:`~lightning_offload.engine.step.orchestrator.StepOrchestrator`).

It shares the user's optimizer's ``param_groups`` dicts, so per-group hyper-parameters and LR schedulers keep working;
that optimizer never steps and holds no state: all state lives on the host, in the slots
(:mod:`~lightning_offload.engine.slots`). ``docs/design.md`` ("The engine") describes the step and each slot kind."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.engine.engine_state import check_engine_state, engine_state, load_engine_state
from lightning_offload.engine.figures.phases import PhaseClock
from lightning_offload.engine.figures.step_figures import StepFigures
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.lanes.ranks import RankShards
from lightning_offload.engine.lanes.link import UpdateRing, default_update_buffers, device_memory_bytes
from lightning_offload.engine.lanes.worker import HostWorker
from lightning_offload.engine.late_params import LateParameters
from lightning_offload.engine.rows.block_row_adam import RowAdamSettings
from lightning_offload.engine.rows.row_gradients import RowGradients
from lightning_offload.engine.rules.host_rule import MEFT_ROWS, host_rule_for
from lightning_offload.engine.settings import OffloadSettings, engine_settings
from lightning_offload.engine.slots.row_blocks_slot import HostRowBlocks, RowBlocksSlot
from lightning_offload.engine.slots.slot import Slot
from lightning_offload.engine.slots.slot_building import build_slots, group_positions
from lightning_offload.engine.step.clipping import GradientNorms
from lightning_offload.engine.step.device_optimizer import DeviceOptimizer
from lightning_offload.engine.step.gradient_edits import GradientEdits
from lightning_offload.engine.step.commit_policies import commit_policy
from lightning_offload.engine.step.orchestrator import StepOrchestrator
from lightning_offload.engine.step.sizes import (
    device_persistent_bytes, device_state_bytes, host_state_bytes, state_tensors)
from lightning_offload.engine.user_optimizer import (
    LINK_DTYPES, check_engine_arguments, hooked_load_state_dict, hooked_state_dict, is_decoupled, named_parameters_of,
    share_hooks, validate_user_optimizer)
from lightning_offload.lsp.channel_scales import ScaledWeight
from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector

__all__ = ["LINK_DTYPES", "OffloadOptimizer", "validate_user_optimizer"]


class OffloadOptimizer(Optimizer):
    """Adam/AdamW whose state and arithmetic live on the host, stepped tensor by tensor through a pipeline.

    Each offloaded tensor's gradient goes device→host as soon as backward has produced it (last micro-batch
    only), a host worker thread runs its Adam step, and its update comes back; the device applies it right before
    the owning module's next forward (a forward pre-hook). With ``pipelined=False`` every update is applied before
    :meth:`step` returns; both modes run the same arithmetic, so their results are identical. The offload
    strategies build one in place of the Adam/AdamW from ``configure_optimizers``; build one yourself for a plain
    PyTorch loop, and :meth:`close` it when done.

    Args:
        optimizer: the user's ``torch.optim.Adam``/``AdamW``; its ``param_groups`` are shared, never copied.
        projected: the projected weights that ``optimizer`` trains (a ``ScaledWeight``: by the scaled rule).
        device: the training device (where parameters and ``S`` buffers live).
        model: the module holding the parameters; needed for ``settings.pipelined`` (its forward pre-hooks apply
            updates just in time). Default: ``None``.
        settings: what the engine reads of the offload settings (:class:`~lightning_offload.engine.settings.
            OffloadSettings`): ``pipelined``, ``link_dtype``, ``on_nonfinite``, ``seed`` (stochastic rounding's
            generators), ``update_buffers``, ``speculative`` and ``free_sent_gradients`` (``None``: off, torch's
            semantics). Default: ``None`` (the settings' defaults but ``pipelined=False``: every update is applied in
            :meth:`step`).
        keep_on_device: parameters stepped on the device instead of the host (``DeviceOptimizer``): clipped and
            checked like the rest, state on the device. Default: ``()``.
        row_sparse: embedding weights stepped row-sparsely on the host: only the rows with a nonzero gradient cross each
            way and are stepped (:class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`). Default: ``()``.
        frozen: parameters of the user's groups not trained here (their gradients turned off). Default: ``()``.
        tied_projected: projected weights also used outside their module (an input embedding tied to a projected
            head): their update is applied inside the step, the outside use's gradient compressed. Default: ``()``.
        data_parallel: the ranks this optimizer trains with (:mod:`lightning_offload.engine.lanes.ranks`):
            gradients are reduced to each tensor's owner rank, which alone keeps its host state and steps it, and
            updates are broadcast from there. Default: ``None`` (one process).
        one_by_one: the settings as keyword arguments, as this constructor took them before ``settings`` (its fields'
            names, and ``rounding_seed`` for ``seed``): they replace those of ``settings``. Default: none.

    Example::

        model = torch.nn.Linear(256, 256)
        optimizer = OffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), [], torch.device("cpu"),
                                     settings=OffloadSettings(pipelined=False, link_dtype="bf16"))
        for batch in batches:
            model(batch).square().mean().backward()
            optimizer.step(); optimizer.zero_grad()  # the Adam state and arithmetic live on the host
        optimizer.close()
    """

    def __init__(
        self,
        optimizer: Optimizer,
        projected: Iterable[ProjectedWeight | ScaledWeight],
        device: torch.device,
        model: torch.nn.Module | None = None,
        settings: OffloadSettings | None = None,
        *,
        keep_on_device: Sequence[Tensor] = (),
        row_sparse: Sequence[Tensor] = (),
        frozen: Sequence[Tensor] = (),
        tied_projected: Sequence[Tensor] = (),
        data_parallel: RankShards | None = None,
        **one_by_one: Any,
    ) -> None:
        optimizer = validate_user_optimizer(optimizer)
        settings = engine_settings(settings, one_by_one)
        link_dtype, on_nonfinite, pipelined = settings.link_dtype, settings.on_nonfinite, settings.pipelined
        check_engine_arguments(link_dtype, on_nonfinite, pipelined and model is None,
                               data_parallel is not None and bool(row_sparse))
        # Optimizer.__init__ keeps the very dicts it is given: the groups (and, below, the list) are the user's.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        share_hooks(self, optimizer)
        self.wrapped = optimizer
        #: The offload settings this engine runs under (``free_sent_gradients`` as its face resolved ``None``).
        self.settings = settings
        self.device = torch.device(device)
        self.pipelined = pipelined
        self.on_nonfinite = on_nonfinite
        self.ranks = data_parallel
        if self.ranks is not None:
            self.ranks.reduce_dtype = LINK_DTYPES[link_dtype]  # gradients cross between ranks as they cross the link
        #: Where the engine's own share of each step goes, by phase (off unless a benchmark turns it on).
        self.phases = PhaseClock(self.device)
        self.lanes = Lanes(self.device, LINK_DTYPES[link_dtype], self.ranks, host_rule_for(optimizer), self.phases)
        self.figures = StepFigures()
        self.telemetry = self.figures.telemetry
        self.timelines = self.figures.timelines

        self._build_slots(optimizer, projected, model, keep_on_device, frozen, row_sparse, settings.seed)
        self.norms = GradientNorms(self.device, self.ranks)
        self.norms.positions = group_positions(self.param_groups)
        if self.ranks is None:
            self.norms.edits = GradientEdits(self.slots)
        # Speculation is for an asynchronous link (a GPU's, the simulated one): with the CPU as the device and its
        # copies done when issued, host work during backward competes with it for the cores.
        speculative = settings.speculative
        self.commit = commit_policy(speculative if speculative is not None else self.lanes.link.asynchronous,
                                    self.lanes.worker)
        self.orchestrator = StepOrchestrator(
            self.lanes, self.slots, self.device_optimizer, self.commit, self.norms, self.figures, on_nonfinite,
            pipelined, model, {id(p) for p in tied_projected}, bool(settings.free_sent_gradients))
        if self.projected_layers:
            largest = max(math.prod(layer.compressed_shape) for layer in self.projected_layers)
            update_buffers = settings.update_buffers
            if update_buffers is None:
                # Updates cross into device buffers where the link copies asynchronously (one per layer, within a
                # share of the device's memory); else the device reads them where the host wrote them.
                update_buffers = default_update_buffers(
                    len(self.projected_layers), largest * self.lanes.link_dtype.itemsize,
                    device_memory_bytes(self.device)) if self.lanes.link.asynchronous else 0
            if update_buffers:
                self.lanes.ring = UpdateRing(update_buffers, largest, self.lanes.link_dtype, self.device)
        self.telemetry.host_state_bytes, self.telemetry.data_parallel = self.host_state_bytes(), self.ranks is not None
        self.telemetry.device_persistent_bytes = self.device_persistent_bytes()
        self.closed = False

    def _build_slots(self, optimizer: Optimizer, projected: Iterable[ProjectedWeight | ScaledWeight],
                     model: torch.nn.Module | None, keep_on_device: Sequence[Tensor], frozen: Sequence[Tensor],
                     row_sparse: Sequence[Tensor], rounding_seed: int) -> None:
        """Each parameter's slot (the constructor's Args say which kind) and the device Adam of those kept there."""
        on_device = {id(p) for p in keep_on_device}
        # Frozen parameters get no host state and are never stepped, as torch.optim skips a None grad; one unfrozen
        # later, or a group added later, gets its slot at the step where it trains (late_params.py).
        frozen_at_setup = [(p, n) for n, p in named_parameters_of(self.param_groups, model) if not p.requires_grad]
        left_out = on_device | {id(p) for p in frozen} | {id(p) for p, _ in frozen_at_setup}
        try:
            self.slots: list[Slot] = build_slots(
                self.param_groups, list(projected), self.lanes, model, left_out, {id(p) for p in row_sparse},
                rounding_seed, lambda group: is_decoupled(optimizer, group))
        except BaseException:
            self.lanes.close()  # a refused set-up leaves no worker or link thread behind
            raise
        self.late = LateParameters(self.param_groups, self.slots, on_device, {id(p) for p in frozen}, frozen_at_setup,
                                   {id(p): name for name, p in model.named_parameters()} if model is not None else {})
        self.projected_layers = [slot.layer for slot in self.slots if slot.layer is not None]
        for layer in self.projected_layers:
            layer.phases = self.phases
        kept = [(p, group, is_decoupled(optimizer, group)) for group in self.param_groups for p in group["params"]
                if id(p) in on_device]
        names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
        self.device_optimizer: DeviceOptimizer | None = DeviceOptimizer(
            kept, self.lanes.rule, [names.get(id(p), f"param{i}") for i, (p, _, _) in enumerate(kept)]) \
            if kept else None

    # ----------------------------------------------------------------------------------------------- the parts
    @property
    def projected_names(self) -> list[str]:
        """The qualified names of the modules whose weights are projected (under ``update="scaled"``: scaled), in
        the order the set-up found them; a weight several modules hold gives each module's name."""
        return [name for layer in self.projected_layers for name in getattr(layer, "names", [layer.name])]

    @property
    def worker(self) -> HostWorker:
        """The host worker thread that runs every slot's host job."""
        return self.lanes.worker

    @property
    def update_ring(self) -> UpdateRing | None:
        """The device buffers compressed updates land in (``None`` on the CPU)."""
        return self.lanes.ring

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer this one drives: Lightning's ``LearningRateMonitor`` reads a wrapper's ``.optimizer``
        (as DeepSpeed's), so the learning rate is logged once, as ``lr-AdamW``, not also as ``lr-OffloadOptimizer``."""
        return self.wrapped

    @property
    def step_in_flight(self) -> bool:
        """Whether the latest step's host work may still be running (its figures complete at :meth:`synchronize`)."""
        return self.figures.in_flight

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest step was skipped for a non-finite gradient."""
        return self.orchestrator.last_step_skipped

    # ------------------------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward, backward, clipping hooks), then launch or confirm one host Adam step per tensor."""
        if self.closed:
            raise RuntimeError("step() on a closed offload optimizer: close() handed the model back and stopped its "
                               "host worker, so nothing would be trained. Build a new one (offload(...), a strategy).")
        loss = self.orchestrator.collect(closure) if closure is not None else None
        self._adopt_late_parameters()
        self.orchestrator.decide_and_launch()
        if not self.orchestrator.last_step_skipped:
            # The user's optimizer never steps itself: marked stepped, its LR scheduler's order check does not warn.
            self.wrapped._opt_called = True
        return loss

    def _adopt_late_parameters(self) -> None:
        """Give a slot to each parameter that joined the groups or was unfrozen since set-up (late_params.py)."""
        if self.late.due():
            self.orchestrator.adopt(self.late.take(self.lanes, lambda group: is_decoupled(self.wrapped, group)))
            self.telemetry.host_state_bytes = self.host_state_bytes()

    def synchronize(self) -> None:
        """Apply every pending update now (before reading weights outside training, saving, or evaluating)."""
        self.orchestrator.synchronize()

    def restart_step_clock(self) -> None:
        """Start the next step's device lane now: work done since the last step (a projector fit) is not the step's."""
        self.figures.restart_clock()

    @torch.no_grad()
    def settle_row_decay(self) -> None:
        """Applies the decoupled weight decay that row-sparse embeddings' untouched rows owe, on the host master and the
        device weight: call before the weights are read (evaluation, checkpoints, the end of fit), after synchronize."""
        for slot in self.slots:
            slot.settle()
        self.orchestrator.routing.expose()  # settled modules give back their plain dicts

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear dense gradients (via the user's optimizer) and the ``S`` accumulators."""
        self.wrapped.zero_grad(set_to_none=set_to_none)
        for layer in self.projected_layers:
            layer.zero_grad()

    def close(self) -> None:
        """Apply what is pending, then remove hooks and stop the worker (idempotent); a later step() is refused."""
        self.closed = True
        try:
            if self.lanes.worker.running:
                self.synchronize()
                self.settle_row_decay()  # the weights handed back are AdamW's
        finally:
            self.orchestrator.routing.remove()
            self.lanes.close()

    # ----------------------------------------------------------------------------------------------- clipping
    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """Global 2-norm of the full gradient, on the device: exact for dense gradients, estimated for projected ones.

        A projected weight's full gradient ``G`` never exists; its norm is estimated as ``‖S‖ / ρ``, with ``ρ`` the
        layer's ``‖S‖/‖G‖`` measured after its last fit (:mod:`lightning_offload.lsp.norm_ratio`) and, while clipping
        by norm is in use, from every step's backward (:mod:`lightning_offload.lsp.norm_probe`), so
        ``gradient_clip_val`` means what it means for plain AdamW.
        """
        return self.orchestrator.grad_norm()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clip all gradients to global norm ``max_norm`` (see :meth:`grad_norm`); returns the norm before clipping.

        Same rule as ``torch.nn.utils.clip_grad_norm_`` (``coef = min(1, max_norm / (norm + 1e-6))``), applied on the
        host as the gradients arrive: bit-identical, and no wait for copies already under way.
        """
        total = self.grad_norm()
        self.norms.clip_norm(total, max_norm)
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element (compressed and dense) to ``[-clip_value, clip_value]`` (on the host)."""
        self.norms.clip = ("value", float(clip_value))

    # ---------------------------------------------------------------------------------------------- host rows
    def attach_row_blocks(self, blocks: Sequence[HostRowBlocks],
                          settings: Callable[[], RowAdamSettings]) -> list[RowBlocksSlot]:
        """Step host row matrices (MEFT's adapter keys and values) with everything else: one worker, one global norm,
        one clip and skip decision. ``blocks``: each owner's matrices, accumulators and row layout; ``settings``: their
        Adam hyper-parameters, read at each step. Returns one slot per owner, in order: its gradient hooks hand row
        gradients to ``slot.gradients.accumulate``, its forward calls ``slot.wait()`` before reading the rows.

        Raises:
            ValueError: with data parallelism (row gradients are not reduced between ranks), or when called twice.
        """
        if self.ranks is not None:
            raise ValueError("Host row blocks train on one process: their gradients are not reduced between ranks.")
        if self.norms.rows is not None:
            raise ValueError("This optimizer already steps host row blocks; attach them all in one call.")
        self.lanes.rule.refuse_rows(*MEFT_ROWS)
        gradients = RowGradients(self.lanes.worker, self.lanes.link)
        slots = [RowBlocksSlot(rows, settings, gradients, self.lanes) for rows in blocks]
        self.orchestrator.take_on(slots)  # after every other slot: their jobs queue last, the forward reads them last
        self.norms.rows = gradients
        return slots

    # ------------------------------------------------------------------------------------------------------ refit
    @torch.no_grad()
    def replace_projectors(
        self, layer: ProjectedWeight, proj_out: SparseProjector, proj_in: SparseProjector, norm_ratio: float = 1.0,
        second_moment_scale: float = 1.0,
    ) -> None:
        """Install new projectors for ``layer`` and carry its host Adam moments into the new subspace. Pending updates
        are applied first (they belong to the old subspace); the moments are mapped on the host
        (:func:`~lightning_offload.lsp.rotation.rotate_moments`), only ``d × d`` maps cross. ``norm_ratio``: the new
        projectors' ``‖S‖/‖G‖`` on sampled gradients; ``second_moment_scale``: ``(‖S_new‖/‖S_old‖)²``, applied to ``v``.

        Raises:
            ValueError: if ``layer`` is not offloaded here or the compressed sizes change.
        """
        slot = next((s for s in self.slots if s.layer is layer), None)
        if slot is None:
            raise ValueError(f"Layer {layer.name} is not one of this optimizer's projected layers.")
        self.synchronize()
        slot.replace_projectors(proj_out, proj_in, norm_ratio, second_moment_scale)

    # ----------------------------------------------------------------------------------------------- accounting
    def host_state_bytes(self) -> int:
        """Bytes of optimizer state on the host: Adam moments, fp32 masters, ``Z`` and landing/staging buffers."""
        return host_state_bytes(self.slots, self.commit)

    def device_persistent_bytes(self) -> dict[str, int]:
        """Device bytes the offload machinery keeps between steps, by category (any device, ``meta`` too)."""
        return device_persistent_bytes(self.slots, self.lanes.ring, self.device_optimizer)

    def device_state_bytes(self) -> int:
        """Bytes of optimizer state found on a non-CPU device (the placement check: expected 0 on a GPU)."""
        return device_state_bytes(self.slots, self.commit)

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of optimizer state this optimizer keeps (host moments, masters, staging buffers, backups)."""
        return state_tensors(self.slots, self.commit)

    # ----------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Everything needed to resume exactly (:func:`~lightning_offload.engine.engine_state.engine_state`), between
        the state-dict hooks of this optimizer and the user's (as torch calls them)."""
        return hooked_state_dict(self, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        self.synchronize()
        return engine_state(self.slots, self.param_groups, self.device_optimizer, self.telemetry, self.ranks,
                            self.lanes.rule)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict` output (between the load hooks, as torch calls them); all state stays on the
        host, projectors go to the device. Call after the model weights are restored (Lightning does): fp32 masters
        are refreshed from them. Parameters that joined since set-up (a group added again first) get slots first.

        Raises:
            ValueError: when the checkpoint was written for different layers, param groups or placements.
        """
        hooked_load_state_dict(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._adopt_late_parameters()
        check_engine_state(state_dict, self.slots, self.device_optimizer, self.lanes.rule)
        self.synchronize()
        for slot in self.slots:
            slot.wait_for_send_back()  # host buffers are overwritten next: copies still reading them must finish
        load_engine_state(state_dict, self.slots, self.param_groups, self.device_optimizer, self.telemetry)
        self.telemetry.host_state_bytes = self.host_state_bytes()
