"""What crosses between data-parallel ranks for the offload optimizer: gradients reduced to their owner, updates
broadcast from it.

Every rank trains the same model on its own share of each batch. The host optimizer is *sharded*: each offloaded
tensor has one owner rank, chosen so every rank's host steps about the same number of elements, and only the owner
keeps its Adam state, steps it and sends its update. Per step:

1. **Gradients**, during backward: tensors are grouped into buckets in backward order (never mixing owners, at most
   ``bucket_bytes`` each, as DDP does); once every tensor of a bucket has its final gradient, the bucket is
   flattened and *reduced* (summed) onto its owner, asynchronously, in bucket order on every rank (collectives must
   be issued in the same order everywhere). A projected weight contributes its compressed gradient ``S = A G Bᵀ``:
   projection is linear, so the sum of the ranks' ``S`` is the ``S`` of the summed gradient, exactly, when all
   ranks hold the same projectors. The owner divides by the world size (the mean, as DDP) and sends it to its host.
   Parameters stepped by a device Adam are all-reduced instead: every rank steps them.
2. **The global norm**: each rank's norm² over the gradients it owns, summed across ranks (one small all-reduce,
   which also tells every rank which tensors had a gradient on any rank).
3. **Updates**, when each is applied (right before its module's next forward): the owner's update (a projected
   weight's compressed ``U``, or a dense parameter's new value) is broadcast to the other ranks, which apply it the
   same way, so every rank's weights stay identical.

The bytes each rank hands to these collectives are counted per step (``offload/bytes_between_ranks``), an all-reduce
as two passes (a reduce and a broadcast), so that every figure compares with plain DDP's ``2 × gradient bytes``. They
are payload sizes, not wire bytes: a ring reduce or broadcast moves about ``(N − 1)/N`` of its payload per rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

#: DDP's default bucket size.
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(eq=False)
class ReducedTensor:
    """One tensor whose gradient is reduced between ranks.

    Attributes:
        key: the optimizer's handle for it (its slot, or the parameter for a device-Adam one).
        gradient: returns the current local gradient (``None`` when it has none) — read when its bucket launches.
        numel: elements of that gradient.
        owner: the rank that steps it; ``None`` when every rank does (all-reduced).
    """

    key: Any
    gradient: Callable[[], Tensor | None]
    numel: int
    owner: int | None
    ready: bool = False
    bucket: _Bucket | None = None


@dataclass(eq=False)
class _Bucket:
    tensors: list[ReducedTensor]
    owner: int | None
    numel: int
    waiting: int = 0
    flat: Tensor | None = None
    work: Any = None
    offsets: list[int] = field(default_factory=list)


def contiguous_owners(sizes: Sequence[int], world: int) -> list[int]:
    """Owner rank of each tensor, given in forward order: contiguous runs, each summing to about ``sum(sizes) / world``
    host elements (contiguous, so a bucket of neighbouring tensors has one owner). A tensor goes to the rank whose
    share its middle falls in; a rank may own nothing when there are fewer tensors than ranks."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}.")
    total = sum(sizes)
    owners, done, rank = [], 0, 0
    for size in sizes:
        while rank < world - 1 and done + size / 2 > total * (rank + 1) / world:
            rank += 1
        owners.append(rank)
        done += size
    return owners


class RankShards:
    """Reduction, ownership and broadcasts between the ranks of the default process group (set up by Lightning).

    Args:
        bucket_bytes: largest payload of one gradient bucket.
        reduce_dtype: dtype gradients cross between ranks in (the link dtype: ``bfloat16`` halves the bytes).
        on_reduced: called on the owner with the key of each owned tensor whose reduced gradient has been written
            back (the optimizer then sends it to its host).
    """

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, reduce_dtype: torch.dtype = torch.float32,
                 on_reduced: Callable[[Any], None] | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("RankShards needs torch.distributed initialised (Lightning's DDP strategy does this); "
                               "use the single-device strategy for one process.")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}.")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.bucket_bytes = bucket_bytes
        self.reduce_dtype = reduce_dtype
        self.on_reduced = on_reduced
        # NCCL's wait() only orders the current CUDA stream after the collective (the host does not block), so a
        # bucket is finished as soon as it is launched; gloo's wait() blocks, so its buckets are polled instead.
        self.stream_ordered = dist.get_backend() == "nccl"
        self.buckets: list[_Bucket] = []
        self._by_key: dict[int, ReducedTensor] = {}
        self.reset()

    # ------------------------------------------------------------------------------------------------ set-up
    def build(self, tensors: Sequence[ReducedTensor]) -> None:
        """Group ``tensors`` (given in forward order) into buckets in backward order: the order their gradients
        are expected in, and the order every rank launches them in."""
        self.buckets, self._by_key = [], {}
        itemsize = torch.empty((), dtype=self.reduce_dtype).element_size()
        current: _Bucket | None = None
        for tensor in reversed(tensors):
            fits = current is not None and current.owner == tensor.owner and (
                (current.numel + tensor.numel) * itemsize <= self.bucket_bytes)
            if not fits:
                current = _Bucket([], tensor.owner, 0)
                self.buckets.append(current)
            current.tensors.append(tensor)
            current.numel += tensor.numel
            tensor.bucket = current
            self._by_key[id(tensor.key)] = tensor
        self.reset()

    def owned(self, owner: int | None) -> bool:
        """Whether this rank steps a tensor of that owner."""
        return owner is None or owner == self.rank

    # ------------------------------------------------------------------------------------------------ per step
    def reset(self) -> None:
        """Forget the current step's reductions (after the step, or when it is abandoned)."""
        for bucket in self.buckets:
            bucket.waiting = len(bucket.tensors)
            bucket.flat, bucket.work = None, None
            for tensor in bucket.tensors:
                tensor.ready = False
        # Buckets launch and finish in order: those before _next_finish are done, those before _next_launch under way.
        self._next_launch = self._next_finish = 0
        self.bytes_this_step = 0

    def is_ready(self, key: Any) -> bool:
        """Whether ``key``'s gradient was declared final in this step already."""
        return self._by_key[id(key)].ready

    def ready(self, key: Any) -> None:
        """During backward: ``key``'s gradient is final. Launches every bucket that is now complete, in order, and
        finishes those whose reduction has completed."""
        tensor = self._by_key[id(key)]
        if not tensor.ready:
            tensor.ready = True
            tensor.bucket.waiting -= 1
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].waiting == 0:
            self._launch(self.buckets[self._next_launch])
        self.poll()

    def poll(self) -> None:
        """Finish the launched buckets whose reductions have completed (in order; stops at the first that has not)."""
        while self._next_finish < self._next_launch:
            if not self.stream_ordered and not self.buckets[self._next_finish].work.is_completed():
                return
            self._finish(self.buckets[self._next_finish])

    def finish(self) -> None:
        """Launch every bucket not launched yet (with whatever gradients exist now) and wait for all of them."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        while self._next_finish < len(self.buckets):
            self._finish(self.buckets[self._next_finish])

    def _launch(self, bucket: _Bucket) -> None:
        device_grads = [tensor.gradient() for tensor in bucket.tensors]
        reference = next((g for g in device_grads if g is not None), None)
        device = reference.device if reference is not None else torch.device("cpu")
        flat = torch.empty(bucket.numel, dtype=self.reduce_dtype, device=device)
        offset, bucket.offsets = 0, []
        for tensor, grad in zip(bucket.tensors, device_grads):
            bucket.offsets.append(offset)
            part = flat[offset: offset + tensor.numel]
            # A rank without this gradient adds nothing (the step's presence count then refuses the step).
            if grad is not None:
                part.copy_(grad.reshape(-1))
            else:
                part.zero_()
            offset += tensor.numel
        if bucket.owner is None:
            bucket.work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)
        else:
            bucket.work = dist.reduce(flat, dst=bucket.owner, op=dist.ReduceOp.SUM, async_op=True)
        bucket.flat = flat
        self.bytes_this_step += flat.numel() * flat.element_size() * (2 if bucket.owner is None else 1)
        self._next_launch += 1

    def _finish(self, bucket: _Bucket) -> None:
        bucket.work.wait()
        self._next_finish += 1
        if not self.owned(bucket.owner):
            bucket.flat = None
            return
        bucket.flat.div_(self.world)  # the mean over ranks, as DDP: a rank's loss is the mean over its batch share
        for tensor, offset in zip(bucket.tensors, bucket.offsets):
            grad = tensor.gradient()
            if grad is not None:
                grad.copy_(bucket.flat[offset: offset + tensor.numel].view_as(grad))
            if self.on_reduced is not None and grad is not None:
                self.on_reduced(tensor.key)
        bucket.flat = None

    # --------------------------------------------------------------------------------------------- collectives
    def all_reduce_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over ranks in place (blocking); returns it."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        self.bytes_this_step += 2 * tensor.numel() * tensor.element_size()  # a reduce and a broadcast
        return tensor

    def broadcast_(self, tensor: Tensor, src: int) -> Tensor:
        """Overwrite ``tensor`` with ``src``'s (in stream order on NCCL, blocking on gloo); returns it."""
        dist.broadcast(tensor, src=src)
        self.bytes_this_step += tensor.numel() * tensor.element_size()
        return tensor

    def gather_to_zero(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (``None`` elsewhere): for checkpoints of the sharded host state."""
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every rank (pickled: small objects, or CPU tensors)."""
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
