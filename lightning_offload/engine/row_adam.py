"""Row-sparse Adam on the host for an embedding: only the rows a step's tokens touched are read and written.

An embedding's gradient is zero outside the rows of the batch's tokens (a few thousand of a vocabulary of tens of
thousands), yet dense Adam streams every row of the weight and both moments through memory each step.
:class:`HostRowAdam` steps only the touched rows, and catches up what dense Adam would have done to a row's moments
and decoupled weight decay over the steps it was not touched, so its state matches dense AdamW's with zero gradients
on those steps. What it does not reproduce is the drift of a skipped row's weight by its decaying momentum (dense
Adam keeps moving a row for a while after its token stops appearing; this leaves it where it was).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class HostRowAdam:
    """Adam (or AdamW) over the rows of one fp32 host matrix, one step counter for the whole matrix.

    At each step, for the rows given (each touched row ``r``, last stepped at step ``s_r``, at step ``t``; the gap
    ``g_r = t − 1 − s_r`` is the number of steps it missed):

    * moments catch up first: ``m_r ← β₁^g m_r``, ``v_r ← β₂^g v_r`` (what ``g`` zero-gradient steps of dense Adam
      give), and decoupled weight decay likewise ``w_r ← (1 − lr·λ)^g w_r`` (at the current ``lr``);
    * then the ordinary Adam step with bias corrections of ``t``, by torch's fused Adam/AdamW kernel on the gathered
      rows: a row touched at every step gets exactly dense fused Adam's arithmetic (the catch-up factors are 1).

    Coupled L2 (Adam's ``weight_decay``) is added to the touched rows' gradients only; ``amsgrad`` is not supported.
    Workspaces are kept at the most rows a step has touched so far (grown by doubling), so a step allocates only when
    it touches more rows than every step before it.

    Args:
        param: the fp32 host master ``[rows, width]``, updated in place.
    """

    def __init__(self, param: Tensor) -> None:
        if param.device.type != "cpu" or param.dtype != torch.float32 or param.ndim != 2:
            raise ValueError(f"HostRowAdam steps an fp32 host matrix; got {tuple(param.shape)} {param.dtype} on "
                             f"{param.device}.")
        self.param = param
        self.exp_avg = torch.zeros_like(param)
        self.exp_avg_sq = torch.zeros_like(param)
        self.step_count = 0
        # The step at which each row was last stepped (0: never), for the catch-up over its gap.
        self.last_step = torch.zeros(param.shape[0], dtype=torch.int64)
        # The step through which each row's decoupled decay has been applied: its last step, or later where
        # settle_decay applied what it owed before the weights were read (then its next step must not apply it again).
        self.decayed_step = torch.zeros(param.shape[0], dtype=torch.int64)
        self._capacity = 0
        self._rows_touched = 0
        self._step = torch.zeros((), dtype=torch.float32)  # the step count the fused kernel reads

    def _workspace(self, count: int) -> tuple[Tensor, ...]:
        """Views of ``count`` rows of the gathered weight, moments and per-row factors (grown by doubling, never
        shrunk)."""
        if count > self._capacity:
            capacity = min(max(count, 2 * self._capacity), self.param.shape[0])
            width = self.param.shape[1]
            # Dtypes spelled out: this may run on a worker thread while the main thread's forward has changed
            # torch's process-wide default dtype (Lightning's bf16-true precision does, during the forward).
            fp32 = torch.float32
            self._buffers = [torch.empty(capacity, width, dtype=fp32) for _ in range(3)]
            self._row_factors = [torch.empty(capacity, 1, dtype=fp32) for _ in range(3)]
            self._gaps = torch.empty(capacity, 1, dtype=fp32)
            self._last = torch.empty(capacity, dtype=torch.int64)
            self._capacity = capacity
        return (*(b[:count] for b in self._buffers), *(f[:count] for f in self._row_factors), self._gaps[:count],
                self._last[:count])

    @torch.no_grad()
    def step(self, rows: Tensor, grad: Tensor, *, lr: float, betas: tuple[float, float], eps: float,
             weight_decay: float = 0.0, decoupled: bool = True, maximize: bool = False) -> Tensor:
        """One step on ``rows`` (unique int64 indices) with their gradients ``grad`` (``[len(rows), width]`` fp32,
        contiguous). Returns the stepped rows' new values (a view of a workspace, valid until the next step)."""
        count = rows.numel()
        self.step_count += 1
        self._rows_touched = count
        if count == 0:
            return self.param[:0]  # a step whose batch touched no row (all padding): only the count advances
        weight, exp_avg, exp_avg_sq, factor1, factor2, decay, gaps, last = self._workspace(count)
        beta1, beta2 = betas
        torch.index_select(self.param, 0, rows, out=weight)
        torch.index_select(self.exp_avg, 0, rows, out=exp_avg)
        torch.index_select(self.exp_avg_sq, 0, rows, out=exp_avg_sq)
        # Steps each row missed: its moments (and decoupled decay) are caught up as dense Adam's would have been; a
        # row touched at the previous step gets factors of exactly 1.
        torch.index_select(self.last_step, 0, rows, out=last)
        gaps.copy_(last.unsqueeze(1)).neg_().add_(self.step_count - 1)
        exp_avg.mul_(torch.pow(beta1, gaps, out=factor1))
        exp_avg_sq.mul_(torch.pow(beta2, gaps, out=factor2))
        if weight_decay and decoupled:
            torch.index_select(self.decayed_step, 0, rows, out=last)
            gaps.copy_(last.unsqueeze(1)).neg_().add_(self.step_count - 1)  # the decay it still owes
            weight.mul_(torch.pow(1.0 - lr * weight_decay, gaps, out=decay))
        # Then torch's own fused Adam/AdamW kernel on the gathered rows, at the matrix's step count (one pass;
        # coupled L2 and maximize as torch.optim.Adam applies them).
        self._step.fill_(self.step_count)
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel([weight], [grad], [exp_avg], [exp_avg_sq], [], [self._step], lr=lr, beta1=beta1, beta2=beta2,
               weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=maximize)
        self.param.index_copy_(0, rows, weight)
        self.exp_avg.index_copy_(0, rows, exp_avg)
        self.exp_avg_sq.index_copy_(0, rows, exp_avg_sq)
        self.last_step.index_fill_(0, rows, self.step_count)
        self.decayed_step.index_fill_(0, rows, self.step_count)
        return weight

    @torch.no_grad()
    def settle_decay(self, lr: float, weight_decay: float) -> Tensor:
        """Applies to the master the decoupled decay every row owes for the steps it missed (at ``lr``, as the
        catch-up of its next step would), so the weights read now are AdamW's but for momentum drift. Returns the
        rows it changed (their next step then owes nothing for these steps)."""
        owing = torch.nonzero(self.decayed_step < self.step_count).squeeze(1)
        if owing.numel() == 0 or not weight_decay or not lr:
            self.decayed_step.fill_(self.step_count)
            return owing[:0]
        missed = (self.step_count - self.decayed_step[owing]).to(torch.float32).unsqueeze(1)
        self.param.index_copy_(0, owing, self.param[owing] * torch.pow(1.0 - lr * weight_decay, missed))
        self.decayed_step.fill_(self.step_count)
        return owing

    @property
    def rows_touched(self) -> int:
        """Rows the latest step read and wrote."""
        return self._rows_touched

    def state_tensors(self) -> list[Tensor]:
        """Every host tensor this optimizer holds (for memory accounting)."""
        return [self.exp_avg, self.exp_avg_sq, self.last_step, self.decayed_step, *getattr(self, "_buffers", ()),
                *getattr(self, "_row_factors", ()), *([self._gaps, self._last] if self._capacity else [])]

    def state_dict(self) -> dict[str, Any]:
        """Moments, the step count and each row's last step (host tensors, shared, not copied)."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "step": self.step_count,
                "last_step": self.last_step, "decayed_step": self.decayed_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` in place (shapes must match)."""
        for key in ("exp_avg", "exp_avg_sq", "last_step"):
            if tuple(state[key].shape) != tuple(getattr(self, key).shape):
                raise ValueError(f"Row-sparse Adam state {key} has shape {tuple(state[key].shape)}, expected "
                                 f"{tuple(getattr(self, key).shape)}: resume with the same model.")
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.last_step.copy_(state["last_step"])
        # Checkpoints from before settle_decay existed: every row's decay was applied through its last step.
        self.decayed_step.copy_(state.get("decayed_step", state["last_step"]))
        self.step_count = int(state["step"])
