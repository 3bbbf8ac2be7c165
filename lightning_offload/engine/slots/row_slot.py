"""A row-sparse embedding's slot: only the rows with a nonzero gradient (the batch's tokens) cross each way and are
stepped, by the engine's row Adam (:class:`~lightning_offload.engine.rows.block_row_adam.BlockRowAdam`, one row per
block, gathered steps)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from lightning_offload.engine.figures.telemetry import StepTelemetry
from lightning_offload.engine.figures.timeline import StepTimeline
from lightning_offload.engine.lanes import Lanes
from lightning_offload.engine.lanes.link import CopyLabel
from lightning_offload.engine.rows.block_row_adam import BlockRowAdam, RowAdamSettings
from lightning_offload.engine.slots.slot import Clip, JobSettings, Slot, clip_, pinned_zeros, thread_minor_faults
from lightning_offload.engine.slots.weight_fingerprint import fingerprint


#: ``RowSlot.shown_rows`` for "every row may differ from the master" (weights restored from a checkpoint).
_EVERY_ROW = torch.zeros(0, dtype=torch.int64)


class RowSlot(Slot):
    """An embedding matrix stepped row by row on the host.

    The master and Adam's moments are full-size; the buffers rows cross through (landing, row numbers, staging, the
    fp32 working copy) hold as many rows as the most a step has sent, grown when a step sends more (at the send, on
    the main thread, while no copy or job uses them), of which each step uses the first ``row_count`` rows: a
    batch touches a few thousand rows of a 128K vocabulary.

    Raises:
        ValueError: for a parameter that is not a matrix, or a group with ``amsgrad=True``.
    """

    keeps_master = True
    gradient_is_param_grad = True
    crosses_param_grad = True
    steps_rows = True

    def __init__(self, name: str, param: Tensor, group: dict[str, Any], lanes: Lanes, decoupled: bool) -> None:
        if param.ndim != 2:
            raise ValueError(f"embeddings='sparse' steps the rows of a matrix, but {name} has shape "
                             f"{tuple(param.shape)}. Use embeddings='host' for it.")
        if group.get("amsgrad"):
            raise ValueError(f"embeddings='sparse' does not support amsgrad=True (param group of {name}). Use "
                             f"embeddings='host' or amsgrad=False.")
        super().__init__(name, param, group, lanes, decoupled)
        self.host_param = pinned_zeros(param.shape, False)
        self.host_param.copy_(param.detach())
        self.watch_weights()
        self.row_adam = BlockRowAdam([self.host_param], block_rows=1)
        self.capacity = -1  # rows the buffers below hold (sized at the first send: _hold_rows)
        self._hold_rows(0)
        # Rows whose device values show decay the master has not paid (settle), put back before a training forward.
        self.shown_rows: Tensor | None = None
        self.shown_step = -1  # the step count at the latest settle
        # The step in flight: how many rows, their indices on the device, their new values on the host and the device.
        self.row_count = 0
        self.rows_on_device: Tensor | None = None
        self.row_values: Tensor | None = None
        self.update_on_device: Tensor | None = None

    def _hold_rows(self, count: int) -> None:
        """Size the buffers rows cross through to at least ``count`` rows (main thread, before a send)."""
        if count <= self.capacity:
            return
        pin, width = self.lanes.pin, self.param.shape[1]
        self.capacity = count
        self.host_grad = pinned_zeros((count, width), pin, self.lanes.link_dtype)
        self.host_rows = pinned_zeros((count,), pin, torch.int64)
        # A staging buffer for the new rows: pinned for an async copy to a GPU, or in a narrower parameter dtype.
        # On the CPU an fp32 embedding's rows are read straight from the row Adam's workspace.
        self.host_update = pinned_zeros((count, width), pin, self.param.dtype) \
            if pin or self.param.dtype != torch.float32 else None
        self.host_grad_fp32 = torch.zeros((count, width), dtype=torch.float32) \
            if self.lanes.link_dtype != torch.float32 else None

    def send(self, timeline: StepTimeline) -> None:
        """Send the rows of the gradient that are nonzero (the rows of the batch's tokens)."""
        grad = self.param.grad
        # Which rows: the one host↔device synchronisation of this path (their count sizes the copies). An embedding
        # is the first layer, so its gradient comes last in backward and the wait costs little device time.
        rows = torch.nonzero(grad.ne(0).any(dim=1)).squeeze(1)
        count = rows.numel()
        # The previous step's job and its copy back are done (applied before this layer's forward), so buffers that
        # must grow are replaced with nothing reading them; a copy still reading an old one holds it.
        self._hold_rows(count)
        values = grad.index_select(0, rows)
        if values.dtype != self.lanes.link_dtype:
            values = values.to(self.lanes.link_dtype)
        # Same copy stream, in order: the event of the second copy covers both.
        self.lanes.link.to_host(rows, self.host_rows[:count], CopyLabel(timeline, f"{self.name} (rows)"))
        self.to_host_event = self.lanes.link.to_host(values, self.host_grad[:count], CopyLabel(timeline, self.name))
        self.row_count, self.rows_on_device = count, rows

    def prepare(self, step: StepTelemetry) -> None:
        width = self.param.shape[1]
        step.bytes_device_to_host += self.row_count * (width * self.lanes.link_dtype.itemsize + 8)
        step.bytes_host_to_device += self.row_count * width * self.param.element_size()
        step.sparse_rows += self.row_count
        if self.lanes.ring is not None or self.lanes.link.asynchronous:
            # The rows' new values land here; the apply scatters them into the weight.
            self.update_on_device = torch.empty((self.row_count, width), dtype=self.param.dtype,
                                                device=self.lanes.device)

    def host_step(self, clip: Clip, compute_done: Any, step: StepTelemetry, settings: JobSettings,
                  speculative: bool = False) -> None:
        """Worker thread: step the touched rows and send their new values back (never speculative)."""
        faults = thread_minor_faults()
        start = time.perf_counter()
        self.lanes.link.host_wait(self.to_host_event)
        landed = time.perf_counter()
        count = self.row_count
        grad = self.host_grad[:count]
        if self.host_grad_fp32 is not None:
            grad = self.host_grad_fp32[:count].copy_(grad)
        clip_(grad, clip)
        hparams, l2_weight = settings
        values = self.row_adam.step_rows(self.host_rows[:count], grad, RowAdamSettings(
            lr=hparams["lr"], betas=hparams["betas"], eps=hparams["eps"], weight_decay=l2_weight,
            decoupled=self.decoupled, maximize=hparams.get("maximize", False)))
        # Rounded to the parameter's dtype here: only its bytes cross.
        staged = self.host_update[:count].copy_(values) if self.host_update is not None else values
        self.row_values = staged
        stepped = time.perf_counter()
        if self.update_on_device is not None:
            self.to_device_event = self.lanes.link.to_device(staged, self.update_on_device, after=compute_done,
                                                             label=CopyLabel(self.timeline, self.name))
        step.host_page_faults += thread_minor_faults() - faults
        self.timeline.add("host_wait", self.name, start, landed)
        self.timeline.add("host", self.name, landed, stepped)

    def finish(self, start: float) -> None:
        values = self.row_values  # the device is the host: read where the host wrote them
        if self.update_on_device is not None:
            self.lanes.link.device_wait(self.to_device_event)
            values = self.update_on_device
        self.timeline.add("device_wait", self.name, start, time.perf_counter())
        self.param.data.index_copy_(0, self.rows_on_device, values)
        self.update_on_device, self.rows_on_device, self.row_values = None, None, None
        self.watch_weights()  # as the engine left it: a write through .data from here on is the user's

    @torch.no_grad()
    def settle(self) -> None:
        """Show the decay idle rows owe: their device rows become the master's with it paid (AdamW's weights but for
        momentum drift), for whatever reads the weights now. The master and the decay ledger stay as they are (each
        row's next step pays it), and the next training forward puts the master's rows back first
        (:meth:`unsettle`), so training is the same, bit for bit, whether or not anything read the weights."""
        if not self.owes_settle():
            return
        rows, (values,) = self.row_adam.decayed_rows()
        if rows.numel():
            self.param.data.index_copy_(0, rows.to(self.param.device), values.to(self.param.device, self.param.dtype))
            self.shown_rows = rows if self.shown_rows is None or self.shown_rows is _EVERY_ROW else \
                torch.cat([self.shown_rows, rows]).unique()
            self.watch_weights()
        self.shown_step = self.row_adam.step_count

    @torch.no_grad()
    def unsettle(self) -> None:
        """Before a training forward: rows shown with their decay paid get the master's values back, as training
        without the read would have them."""
        rows, self.shown_rows, self.shown_step = self.shown_rows, None, -1
        written = rows is not None and (self.weights_written()
                                        or not torch.equal(fingerprint(self.param), self.weights_fingerprint))
        if written and not self.weights_match_master():
            return  # written since it was shown (a clamp of what was read): the step adopts that write as it stands
        if rows is _EVERY_ROW:
            self.param.data.copy_(self.host_param)
        elif rows is not None:
            self.param.data.index_copy_(0, rows.to(self.param.device),
                                        self.host_param[rows].to(self.param.device, self.param.dtype))
        if rows is not None:
            self.watch_weights()

    def owes_settle(self) -> bool:
        # Some idle rows may owe decay that the device does not show yet.
        return self.decoupled and self.row_adam.decay.active and self.shown_step != self.row_adam.step_count

    def master_in_checkpoint(self) -> bool:
        # The device rows may show decay the master has not paid yet: the master is kept as it is.
        return super().master_in_checkpoint() or (self.decoupled and self.row_adam.decay.active)

    def load_master(self, master: Tensor | None) -> None:
        super().load_master(master)
        if master is not None:
            self.shown_rows, self.shown_step = _EVERY_ROW, -1  # the restored weights may show decay: master first

    def weights_match_master(self) -> bool:
        # The master's value, or the master's with the decay idle rows owe shown (weights saved after a settle).
        if super().weights_match_master():
            return True
        rows, (values,) = self.row_adam.decayed_rows()
        shown = self.host_param.clone().index_copy_(0, rows, values)
        return torch.equal(self.param.detach(), shown.to(self.param.device, self.param.dtype))

    def adopted_weights(self) -> None:
        self.row_adam.decay.paid()  # new weights owe no decay of steps taken before them
        self.shown_rows, self.shown_step = None, -1

    def state_tensors(self) -> list[Tensor]:
        tensors = [t for t in (self.host_param, self.host_grad, self.host_update, self.host_grad_fp32) if t is not None]
        return tensors + [self.host_rows, *self.row_adam.state_tensors()]

    def host_state(self) -> dict[str, Any]:
        return self.row_adam.state_dict()

    def load_host_state(self, state: dict[str, Any]) -> None:
        self.row_adam.load_state_dict(state)
