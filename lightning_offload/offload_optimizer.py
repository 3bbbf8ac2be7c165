"""The optimizer that takes over a user's Adam/AdamW: host Adam on compressed and dense gradients.

:class:`OffloadOptimizer` is what the offload strategies put in place of the optimizer returned by
``configure_optimizers``. It shares that optimizer's ``param_groups`` dicts, so per-group hyper-parameters are
honoured and LR schedulers (which write ``param_groups[i]["lr"]``) keep working. The user's optimizer never
steps and holds no state. All optimizer state lives on the host:

* projected weights: Adam on ``S = A G Bᵀ`` with moments of shape ``d_o × d_i``; the update ``U`` is expanded
  on the device (``W ← W·(1 − lr·wd) + Aᵀ U B``);
* every other parameter in the optimizer: fp32 master copy plus Adam moments on the host (ZeRO-Offload style);
  the new value is copied back to the device.

Both host optimizers are ``torch.optim.Adam(fused=True)`` instances over host tensors, so the Adam arithmetic is
PyTorch's own, with one step counter per tensor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_offload.lsp.linear import ProjectedWeight
from lightning_offload.lsp.projector import SparseProjector
from lightning_offload.telemetry import OffloadTelemetry, StepTelemetry

SUPPORTED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)
# Hyper-parameters copied from each user group into the host optimizers' groups before every step.
_SYNCED_HPARAMS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")
NonFinitePolicy = Literal["skip", "raise"]
_STATE_FORMAT = 1


class NonFiniteGradientError(FloatingPointError):
    """Raised when ``on_nonfinite="raise"`` and a step's gradients hold inf or nan."""


@dataclass
class _DenseSlot:
    """A non-projected parameter and its fp32 host master."""

    param: Tensor
    master: Tensor
    grad_buffer: Tensor


@dataclass
class _ProjectedSlot:
    """A projected weight, its host optimisation variable ``Z`` (zeroed every step, so after a step ``Z = U``),
    the host landing buffer for ``S``, and its param group."""

    layer: ProjectedWeight
    z: Tensor
    grad_buffer: Tensor
    group: dict[str, Any]


def _is_decoupled(optimizer: Optimizer, group: dict[str, Any]) -> bool:
    return bool(group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def validate_user_optimizer(optimizer: Any) -> Optimizer:
    """Check the optimizer an offload strategy can take over; return it unwrapped.

    Raises:
        TypeError: for anything but ``torch.optim.Adam``/``AdamW`` (subclasses are refused too: their ``step``
            may do something the host Adam would not reproduce).
    """
    inner = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
    if type(inner) not in SUPPORTED_OPTIMIZERS:
        raise TypeError(
            f"The offload strategies take over torch.optim.Adam or torch.optim.AdamW, but configure_optimizers "
            f"returned {type(inner).__module__}.{type(inner).__qualname__}. Return torch.optim.AdamW(...) (any param "
            f"groups, lr, betas, eps, weight_decay) — its state will live on the host."
        )
    for group in inner.param_groups:
        if group.get("capturable") or group.get("differentiable"):
            raise ValueError(
                "capturable/differentiable Adam cannot be offloaded: the host Adam is neither. Create the optimizer "
                "without capturable=True and differentiable=True."
            )
    return inner


def _pinned_zeros(shape: Sequence[int], pin: bool) -> Tensor:
    # Pinned host memory lets device↔host copies run by DMA (and asynchronously); pinned pages are only worth it
    # when there is a CUDA device on the other end of the link.
    return torch.zeros(tuple(shape), dtype=torch.float32, pin_memory=pin)


class OffloadOptimizer(Optimizer):
    """Adam/AdamW whose state and arithmetic live on the host.

    Args:
        optimizer: the user's ``torch.optim.Adam``/``AdamW``; its ``param_groups`` are shared, never copied.
        projected: the projected weights; each weight that appears in ``optimizer`` takes the compressed path.
        device: the training device (where parameters and ``S`` buffers live).
        on_nonfinite: ``"skip"`` skips a step whose gradients hold inf/nan (counted in telemetry); ``"raise"``
            raises :class:`NonFiniteGradientError`. Either way the host state is untouched.
        rounding_seed: seed of the generator used for stochastic rounding of low-precision projected weights.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        projected: Iterable[ProjectedWeight],
        device: torch.device,
        on_nonfinite: NonFinitePolicy = "skip",
        rounding_seed: int = 0,
    ) -> None:
        optimizer = validate_user_optimizer(optimizer)
        if on_nonfinite not in ("skip", "raise"):
            raise ValueError(f"on_nonfinite must be 'skip' or 'raise', got {on_nonfinite!r}.")
        # Optimizer.__init__ appends the very dicts it is given, so the groups are shared with the user's optimizer
        # (and with any scheduler attached to it); the list itself is shared below as well.
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.wrapped = optimizer
        self.device = torch.device(device)
        self.on_nonfinite = on_nonfinite
        self.telemetry = OffloadTelemetry()
        self._rounding_generator = torch.Generator(device=self.device)
        self._rounding_generator.manual_seed(rounding_seed)
        self._last_grad_norm: Tensor | None = None

        pin = self.device.type == "cuda"
        by_param = {id(layer.weight): layer for layer in projected}
        self.dense_slots: list[_DenseSlot] = []
        self.projected_slots: list[_ProjectedSlot] = []
        dense_groups, projected_groups = [], []
        for group in self.param_groups:
            hparams = {key: group[key] for key in _SYNCED_HPARAMS if key in group}
            dense_params, z_params = [], []
            for param in group["params"]:
                layer = by_param.pop(id(param), None)
                if layer is None:
                    master = _pinned_zeros(param.shape, pin)
                    master.copy_(param.detach())
                    slot = _DenseSlot(param, master, _pinned_zeros(param.shape, pin))
                    self.dense_slots.append(slot)
                    dense_params.append(master)
                else:
                    z = _pinned_zeros(layer.compressed_shape, pin)
                    self.projected_slots.append(_ProjectedSlot(layer, z, _pinned_zeros(z.shape, pin), group))
                    z_params.append(z)
            decoupled = _is_decoupled(optimizer, group)
            dense_groups.append({"params": dense_params, **hparams, "decoupled_weight_decay": decoupled})
            # Weight decay of projected weights is applied to W on the device (decoupled) or added to S on the device
            # (coupled L2), never to Z, whose value is only the step's update.
            projected_groups.append({"params": z_params, **hparams, "weight_decay": 0.0})
        if by_param:
            names = ", ".join(layer.name for layer in by_param.values())
            raise ValueError(
                f"Projected layers {names} have weights that the optimizer does not train; their compressed "
                f"gradients would never be stepped. Add their weights to the optimizer or do not project them."
            )
        self.projected_layers = [slot.layer for slot in self.projected_slots]
        self.host_dense = self._host_adam(dense_groups)
        self.host_projected = self._host_adam(projected_groups)
        self.telemetry.host_state_bytes = self.host_state_bytes()

    @staticmethod
    def _host_adam(groups: list[dict[str, Any]]) -> torch.optim.Adam | None:
        if not any(group["params"] for group in groups):
            return None
        # fused=True: the CPU fused kernel is ~2.6x faster than foreach here (DESIGN.md §8).
        return torch.optim.Adam(groups, fused=True)

    # ------------------------------------------------------------------------------------------------ gradients
    def _gradients(self) -> list[Tensor]:
        grads = [slot.layer.grad_buffer for slot in self.projected_slots if slot.layer.has_grad]
        grads += [slot.param.grad for slot in self.dense_slots if slot.param.grad is not None]
        return grads

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """Global 2-norm over the compressed gradients ``S`` and the dense gradients, on the device.

        ``S`` is the exact gradient of the optimisation variable ``Z`` (``W = W₀ + AᵀZB``), so this is the norm of
        the gradient the host Adam actually sees; with signed-permutation projectors it equals the full norm.
        """
        grads = self._gradients()
        if not grads:
            return torch.zeros((), device=self.device)
        norms = torch._foreach_norm(grads)
        return torch.linalg.vector_norm(torch.stack([n.float().to(self.device) for n in norms]))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale all gradients so their global norm (see :meth:`grad_norm`) is at most ``max_norm``.

        Same rule as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))``.
        """
        total = self.grad_norm()
        self._last_grad_norm = total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = self._gradients()
        if grads:
            torch._foreach_mul_(grads, coef)
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element (compressed and dense) to ``[-clip_value, clip_value]``."""
        for grad in self._gradients():
            grad.clamp_(-clip_value, clip_value)
        self._last_grad_norm = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear dense gradients (via the user's optimizer) and the ``S`` accumulators."""
        self.wrapped.zero_grad(set_to_none=set_to_none)
        for layer in self.projected_layers:
            layer.zero_grad()

    # ------------------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run ``closure`` (forward, backward, clipping hooks), then one host Adam step on its gradients."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        norm = self._last_grad_norm if self._last_grad_norm is not None else self.grad_norm()
        self._last_grad_norm = None
        if not bool(torch.isfinite(norm)):
            self._skip_step(norm)
            return loss
        step = StepTelemetry()
        self._sync_hyperparameters()
        self._gradients_to_host(step)
        start = time.perf_counter()
        for host in (self.host_dense, self.host_projected):
            if host is not None:
                host.step()
        step.host_optimizer_seconds = time.perf_counter() - start
        self._updates_to_device(step)
        for layer in self.projected_layers:
            layer.zero_grad()
        for slot in self.dense_slots:
            slot.master.grad = None
        self.telemetry.last = step
        self.telemetry.steps += 1
        # Adam allocates its moments lazily at the first step, so the size is re-measured after each.
        self.telemetry.host_state_bytes = self.host_state_bytes()
        # torch's LR schedulers track the step of the optimizer they were built with; mark it as stepped so the
        # scheduler's order check does not warn (the user's optimizer never steps itself).
        self.wrapped._opt_called = True  # type: ignore[attr-defined]
        return loss

    def _skip_step(self, norm: Tensor) -> None:
        if self.on_nonfinite == "raise":
            raise NonFiniteGradientError(
                f"Non-finite gradient (global norm {float(norm)}) at optimizer step {self.telemetry.steps}. The host "
                f"state was not touched. Pass on_nonfinite='skip' to the strategy to skip such steps instead."
            )
        for layer in self.projected_layers:
            layer.zero_grad()
        self.telemetry.skipped_steps += 1
        self.telemetry.last = StepTelemetry(skipped=1.0)

    def _sync_hyperparameters(self) -> None:
        # Schedulers and users write the shared user groups; the host optimizers read their own groups.
        for host in (self.host_dense, self.host_projected):
            if host is None:
                continue
            for user_group, host_group in zip(self.param_groups, host.param_groups):
                for key in _SYNCED_HPARAMS:
                    if key in user_group and not (host is self.host_projected and key == "weight_decay"):
                        host_group[key] = user_group[key]

    def _gradients_to_host(self, step: StepTelemetry) -> None:
        for slot in self.projected_slots:
            if not slot.layer.has_grad:
                slot.z.grad = None
                continue
            grad = slot.layer.grad_buffer
            weight_decay = slot.group.get("weight_decay", 0.0)
            if weight_decay and not _is_decoupled(self.wrapped, slot.group):
                # Adam's coupled L2 term, in the compressed space: A (G + λW) Bᵀ = S + λ A W Bᵀ.
                grad = grad + weight_decay * slot.layer.compress_weight()
            slot.grad_buffer.copy_(grad)
            slot.z.grad = slot.grad_buffer
            step.bytes_device_to_host += grad.numel() * grad.element_size()
        for slot in self.dense_slots:
            grad = slot.param.grad
            if grad is None:
                slot.master.grad = None
                continue
            slot.grad_buffer.copy_(grad)
            slot.master.grad = slot.grad_buffer
            step.bytes_device_to_host += grad.numel() * grad.element_size()

    def _updates_to_device(self, step: StepTelemetry) -> None:
        for slot in self.projected_slots:
            if slot.z.grad is None:
                continue
            # Blocking copy: Z is zeroed right below, so the host must not touch it while a copy could still read it.
            # (The layer-wise pipeline replaces these copies with stream-ordered ones and events.)
            update = slot.z.to(self.device)
            step.bytes_host_to_device += update.numel() * update.element_size()
            group = slot.group
            decay = 1.0
            if _is_decoupled(self.wrapped, group):
                decay = 1.0 - group["lr"] * group.get("weight_decay", 0.0)
            slot.layer.apply_update(update, decay, self._rounding_generator)
            slot.z.zero_()
            slot.z.grad = None
        for slot in self.dense_slots:
            if slot.master.grad is None:
                continue
            # Blocking copy: the next host step rewrites the master in place.
            slot.param.data.copy_(slot.master)
            step.bytes_host_to_device += slot.param.numel() * slot.param.element_size()

    # ----------------------------------------------------------------------------------------------- accounting
    def host_state_bytes(self) -> int:
        """Bytes of optimizer state on the host: Adam moments, fp32 masters, ``Z``/landing buffers."""
        return sum(t.numel() * t.element_size() for t in self._state_tensors() if t.device.type == "cpu")

    def device_state_bytes(self) -> int:
        """Bytes of optimizer state found on a non-CPU device (the placement check: expected 0 on a GPU)."""
        return sum(t.numel() * t.element_size() for t in self._state_tensors() if t.device.type != "cpu")

    def _state_tensors(self) -> list[Tensor]:
        tensors = [slot.master for slot in self.dense_slots] + [slot.grad_buffer for slot in self.dense_slots]
        tensors += [slot.z for slot in self.projected_slots] + [slot.grad_buffer for slot in self.projected_slots]
        for host in (self.host_dense, self.host_projected):
            if host is not None:
                tensors += [v for state in host.state.values() for v in state.values() if torch.is_tensor(v)]
        return tensors

    # ----------------------------------------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Everything needed to resume exactly: group hyper-parameters, host moments and step counts, projector
        indices and values, fp32 masters of low-precision dense parameters, the rounding generator, counters."""
        return {
            "format": _STATE_FORMAT,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "host_dense": self.host_dense.state_dict() if self.host_dense is not None else None,
            "host_projected": self.host_projected.state_dict() if self.host_projected is not None else None,
            "projectors": {
                slot.layer.name: {"out": slot.layer.proj_out.state_dict(), "in": slot.layer.proj_in.state_dict()}
                for slot in self.projected_slots
            },
            # fp32 params equal their masters (restored with the model); lower-precision ones don't.
            "dense_masters": [
                slot.master.clone() if slot.param.dtype != torch.float32 else None for slot in self.dense_slots
            ],
            "rounding_generator": self._rounding_generator.get_state(),
            "telemetry": self.telemetry.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict` output; all state stays on the host, projectors go to the device.

        Call after the model weights are restored (Lightning does), since fp32 masters are refreshed from them.

        Raises:
            ValueError: when the checkpoint was written for different layers or param groups.
        """
        if state_dict.get("format") != _STATE_FORMAT:
            raise ValueError(
                "This optimizer state was not written by lightning_offload's OffloadOptimizer (or by another format "
                "version); resume with the strategy that wrote the checkpoint."
            )
        saved_names = list(state_dict["projectors"])
        names = [slot.layer.name for slot in self.projected_slots]
        if saved_names != names or len(state_dict["dense_masters"]) != len(self.dense_slots):
            raise ValueError(
                f"Checkpoint has projected layers {saved_names[:3]}… and {len(state_dict['dense_masters'])} dense "
                f"params, but this run has {names[:3]}… and {len(self.dense_slots)}: resume with the same model, "
                f"strategy settings (rank, density, patterns) and optimizer groups."
            )
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        for host, key in ((self.host_dense, "host_dense"), (self.host_projected, "host_projected")):
            if host is not None:
                host.load_state_dict(state_dict[key])
        for slot in self.projected_slots:
            saved = state_dict["projectors"][slot.layer.name]
            slot.layer.set_projectors(
                SparseProjector.from_state_dict(saved["out"], self.device),
                SparseProjector.from_state_dict(saved["in"], self.device),
            )
        for slot, master in zip(self.dense_slots, state_dict["dense_masters"]):
            slot.master.copy_(master if master is not None else slot.param.detach())
        self._rounding_generator.set_state(state_dict["rounding_generator"])
        self.telemetry.load_state_dict(state_dict["telemetry"])
        self.telemetry.host_state_bytes = self.host_state_bytes()
