"""Gradient synchronizer: bucketed all-reduce of replicated gradients, overlapped with backward.

Why our own instead of DistributedDataParallel: DDP wraps and owns the model, reduces over one group
and averages. Here each parameter carries its own replicate mesh (dense weights over `dp_cp_replicate`,
experts over `ep_replicate`, FSDP shards over the HSDP replicate dim), the loss is a weighted sum whose
normalizer is only known globally, and the engine decides the number of microbatches.

Life of one step:
1. Every backward fires a post-accumulate-grad hook per parameter (for FSDP shards, after FSDP's
   reduce-scatter). The hook adds the gradient into the parameter's view of its bucket buffer and drops
   `param.grad`.
2. When every parameter of a bucket has accumulated `num_microbatches` gradients, the bucket is
   complete; complete buckets start an async SUM all-reduce in bucket order (so every rank issues the
   collectives in the same order), while backward of earlier layers still runs.
3. `wait(loss_weight)` (once, before clipping and the optimizer) starts whatever is left (parameters
   unused this step contribute zeros), sums the loss weights over `loss_weight_mesh`, waits, divides every
   buffer by that global sum and exposes `param.grad` as views of the buffers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from d9d.core.dtensor import local_tensor
from d9d.parallel.grad_sync.bucket import GradBucket, scale_
from d9d.parallel.grad_sync.config import GradSyncConfig
from d9d.parallel.grad_sync.reduce_mesh import SyncedParam


def mesh_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The process group spanning every rank of `mesh` (None when there is nothing to communicate)."""
    if mesh is None or mesh.size() == 1:
        return None
    if mesh.ndim == 1:
        return mesh.get_group()
    return mesh._flatten().get_group()


_BucketKey = tuple[DeviceMesh | None, torch.dtype, torch.device, int]  # never mixed inside one bucket


@dataclass
class _Slot:
    name: str
    param: nn.Parameter
    bucket: GradBucket
    index: int
    expected: int
    """Accumulations per step before the bucket may be reduced."""
    count: int = 0


class GradientSynchronizer:
    def __init__(
        self,
        params: Sequence[SyncedParam],
        config: GradSyncConfig | None = None,
        *,
        num_microbatches: int = 1,
        loss_weight_mesh: DeviceMesh | None = None,
        once_per_step: Collection[torch.Tensor] = (),
    ) -> None:
        """`once_per_step`: parameters whose gradient arrives once per step whatever the microbatches (FSDP
        shards of a pipeline stage, reduced after its last backward: `d9d.pipeline.runtime.sharding`)."""
        self.config = config or GradSyncConfig()
        self._loss_weight_mesh = loss_weight_mesh
        self.buckets: list[GradBucket] = []
        self._slots: list[_Slot] = []
        self._once = {id(p) for p in once_per_step}
        self.set_num_microbatches(num_microbatches)
        self._build(params)
        self._next_launch = 0
        self._handles: list[RemovableHandle] = []
        for slot in self._slots:
            self._handles.append(slot.param.register_hook(lambda g, s=slot: self._before_accumulate(s, g)))
            self._handles.append(
                slot.param.register_post_accumulate_grad_hook(lambda _p, s=slot: self._on_grad(s))
            )

    # -- construction -------------------------------------------------------------------------------

    def _build(self, params: Sequence[SyncedParam]) -> None:
        """Fill buckets in reverse registration order (≈ the order backward produces gradients)."""
        cap = self.config.bucket_size_mb * 2**20
        open_buckets: dict[_BucketKey, list[SyncedParam]] = {}
        open_bytes: dict[_BucketKey, int] = {}
        closed: list[tuple[_BucketKey, list[SyncedParam]]] = []
        for sp in reversed(params):
            local = local_tensor(sp.param)
            dtype = self.config.resolve_grad_dtype(sp.param.dtype)
            if sp.reduce_dtype is not None:
                # A strategy reduces this gradient in a wider dtype (FSDP's float32 reduce-scatter):
                # accumulating or all-reducing it narrower here would undo that.
                dtype = torch.promote_types(dtype, sp.reduce_dtype)
            key: _BucketKey = (sp.reduce_mesh, dtype, local.device, sp.group)
            nbytes = local.numel() * dtype.itemsize
            current = open_buckets.get(key)
            if current and open_bytes[key] + nbytes > cap:
                closed.append((key, current))
                current = None
            if current is None:
                current = open_buckets[key] = []
                open_bytes[key] = 0
            current.append(sp)
            open_bytes[key] += nbytes
        closed.extend(open_buckets.items())
        # Bucket order = order of the first parameter each holds, so ranks agree on the launch order.
        position = {id(sp.param): i for i, sp in enumerate(reversed(params))}
        closed.sort(key=lambda kv: position[id(kv[1][0].param)])
        groups: dict[DeviceMesh | None, dist.ProcessGroup | None] = {}
        for key, members in closed:
            mesh, dtype, device, _ = key
            if mesh not in groups:
                groups[mesh] = mesh_group(mesh)
            bucket = GradBucket([sp.param for sp in members], dtype, device, groups[mesh])
            self.buckets.append(bucket)
            self._slots.extend(
                _Slot(sp.name, sp.param, bucket, i, self._expected(sp.param)) for i, sp in enumerate(members)
            )

    # -- per step -----------------------------------------------------------------------------------

    def set_num_microbatches(self, num_microbatches: int) -> None:
        """How many backward passes each parameter accumulates before its bucket may be reduced."""
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
        self._num_microbatches = num_microbatches
        for slot in self._slots:
            slot.expected = self._expected(slot.param)

    def _expected(self, param: nn.Parameter) -> int:
        return 1 if id(param) in self._once else self._num_microbatches

    def _before_accumulate(self, slot: _Slot, grad: torch.Tensor) -> torch.Tensor:
        # Autograd would add this step's gradient onto last step's synchronized one.
        if slot.count == 0 and slot.param.grad is not None:
            raise self._stale_error(slot)
        return grad

    def _late_error(self, slot: _Slot) -> RuntimeError:
        return RuntimeError(
            f"gradient of {slot.name!r} arrived once more than expected (its bucket may already be "
            f"reduced): more backward passes than num_microbatches={self._num_microbatches} in this step"
            if slot.expected == self._num_microbatches
            else f"gradient of {slot.name!r} arrived twice in a step, but it is reduced once per step"
        )

    def _stale_error(self, slot: _Slot) -> RuntimeError:
        return RuntimeError(
            f"{slot.name!r} still holds last step's synchronized gradient; call "
            "optimizer.zero_grad(set_to_none=True) (or synchronizer.zero_grad()) before the next backward"
        )

    @torch.no_grad()
    def _on_grad(self, slot: _Slot) -> None:
        grad = slot.param.grad
        if grad is None:
            return
        local = local_tensor(grad)
        bucket = slot.bucket
        # Counted per parameter: a bucket still waiting for another parameter would take it silently.
        if slot.count >= slot.expected or bucket.launched:
            raise self._late_error(slot)
        if local.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr():
            raise self._stale_error(slot)  # FSDP adds its shard into an existing `.grad` in place
        bucket.accumulate(slot.index, local)
        slot.param.grad = None
        slot.count += 1
        if slot.count == slot.expected:
            bucket.mark_complete()
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self.buckets[self._next_launch].launch()
            self._next_launch += 1

    @torch.no_grad()
    def wait(self, loss_weight: float | torch.Tensor | None = None) -> torch.Tensor | None:
        """Finish the step's reduction; divide by the global loss-weight sum when `loss_weight` is given.

        `loss_weight` is this rank's sum of the weights its losses were summed with (e.g. the number of
        target tokens over all its microbatches); it is summed over `loss_weight_mesh`, and the result —
        the normalizer of the global weighted mean — is returned.
        """
        for bucket in self.buckets[self._next_launch :]:
            bucket.launch()
        self._next_launch = len(self.buckets)
        total = None if loss_weight is None else self.global_sum(loss_weight)
        for bucket in self.buckets:
            bucket.wait()
        if total is not None:
            # A float32 scale on the device, as `LocalGradientReducer`'s (bf16 buckets take `_foreach_mul_`'s
            # per-tensor fallback, one kernel per bucket, as `mul_` per bucket did before).
            scale_([bucket.buffer for bucket in self.buckets], total.reciprocal().to(torch.float32))
        for slot in self._slots:
            slot.param.grad = self._expose(slot)
            slot.count = 0
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0
        return total

    def global_sum(self, value: float | torch.Tensor) -> torch.Tensor:
        """`value` summed over `loss_weight_mesh` (the ranks holding distinct data), as float64.

        The engine uses it for the loss weights and for logging the global mean loss."""
        mesh = self._loss_weight_mesh
        device = torch.device(mesh.device_type) if mesh is not None else self._default_device()
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        total = torch.as_tensor(value, dtype=torch.float64).to(device).clone()
        if mesh is not None:
            for dim in range(mesh.ndim):
                if mesh.size(dim) > 1:
                    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        return total

    def _default_device(self) -> torch.device:
        return self.buckets[0].buffer.device if self.buckets else torch.device("cpu")

    def _expose(self, slot: _Slot) -> torch.Tensor:
        param = slot.param
        grad = slot.bucket.view(slot.index)
        if grad.dtype != param.dtype:
            grad = grad.to(param.dtype)
        if isinstance(param, DTensor):
            return DTensor.from_local(
                grad,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        return grad

    def zero_grad(self) -> None:
        for slot in self._slots:
            slot.param.grad = None

    def close(self) -> None:
        """Remove the hooks; the model trains without synchronization afterwards."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
