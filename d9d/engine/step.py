"""Forward/backward over a step's microbatches, and the seams where parallelism plugs in.

`StepRunner` runs every microbatch of a step through the local stage(s) and returns the local loss sum and
weight; the sequential runner does it for one stage, the pipeline runner (d9d.pipeline) for many.
`GradientReducer` finishes gradients after the last backward: DP reduction (d9d.parallel's synchronizer)
and the division by the global loss weight. Keeping these as protocols lets the loop stay the same for a
single process, DP, FSDP, EP and PP.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.core.dtensor import local_tensor
from d9d.core.pytree import tree_map_tensors, tree_to
from d9d.core.types import PyTree
from d9d.engine.providers import LossOutput, TrainTask
from d9d.parallel import clip_coefficient, clip_grad_norm_, global_grad_norm
from d9d.parallel.context import ContextParallelGroup, shard_microbatch
from d9d.parallel.fsdp import fsdp_root
from d9d.parallel.grad_sync import GradientSynchronizer, GradSyncConfig, SyncedParam, collect_synced_params
from d9d.parallel.grad_sync.bucket import scale_
from d9d.pipeline.runtime.executor import PipelineExecutor
from d9d.pipeline.runtime.sharding import StageSharding

logger = logging.getLogger(__name__)


class StepRunner(Protocol):
    #: The pipeline rank whose ranks compute the loss (and so update task metrics).
    loss_pp_rank: int

    def forward_backward(self, microbatches: Sequence[PyTree]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run all microbatches; return local (loss sum, loss weight), zeros where no loss is computed."""
        ...


class GradientReducer(Protocol):
    def finish(self, global_weight: torch.Tensor | None) -> None:
        """After the last backward: finish any reduction and divide gradients by `global_weight`; None leaves
        them sums (the optimizer divides them: `PipelinedOptimizer.divides_gradients`)."""
        ...


class SequentialStepRunner:
    """One stage holds the whole model: plain forward/backward per microbatch, gradients accumulate.

    `sharding`: the model's FSDP units when they reduce once per step (`once_per_step_sharding`): kept
    gathered from the first forward, their gradients accumulated unsharded and reduce-scattered by FSDP's
    own hooks in the last microbatch's backward, each unit as backward reaches it."""

    loss_pp_rank = 0

    def __init__(
        self,
        module: nn.Module,
        task: TrainTask,
        device: torch.device,
        metrics: Mapping[str, Any] | None = None,
        sharding: StageSharding | None = None,
    ) -> None:
        self.module = module
        self.task = task
        self.device = device
        self.metrics = metrics or {}
        self.sharding = sharding

    def forward_backward(self, microbatches: Sequence[PyTree]) -> tuple[torch.Tensor, torch.Tensor]:
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        weight_total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.sharding is not None:
            self.sharding.begin_step()
        for index, microbatch in enumerate(microbatches):
            if self.sharding is not None and index == len(microbatches) - 1:
                # the last backward reduces each unit as it reaches it, overlapping the rest of backward
                self.sharding.reduce_in_next_backward()
            outputs = self.module(**self.task.forward_inputs(microbatch))
            loss: LossOutput = self.task.compute_loss(outputs, microbatch)
            loss.loss_sum.backward()
            with torch.no_grad():
                loss_total += loss.loss_sum.detach().double()
                weight_total += loss.weight.detach().double()
                if self.metrics:
                    self.task.update_metrics(self.metrics, outputs, microbatch, loss)
        if self.sharding is not None:
            self.sharding.end_step()
        return loss_total, weight_total


def once_per_step_sharding(
    module: nn.Module, microbatches: int, grad_sync: GradSyncConfig
) -> StageSharding | None:
    """`module`'s FSDP units when a step of `microbatches` reduces their gradients once, in the last
    microbatch's backward (`fsdp.reduce_every`, d9d.parallel.fsdp), else None: a single microbatch, a
    module that `parallelize_fsdp` did not shard, or the policy choosing every microbatch. The synchronizer
    accumulates in `grad_sync`'s dtype only what reaches it per microbatch; `auto` keeps that when it is
    wider than FSDP's accumulation, `step` is refused then (the job config refuses it earlier for the
    built-in models)."""
    root = fsdp_root(module)
    sharding = StageSharding.of(module) if root is not None and microbatches > 1 else None
    if root is None or sharding is None:
        return None
    wider = [
        p for p in sharding.reduced_params() if grad_sync.accumulates_wider(p.dtype, root.accumulation_dtype)
    ]
    if wider and root.config.reduce_every == "step":
        raise ValueError(
            f"fsdp.reduce_every 'step': FSDP would accumulate the microbatches' gradients in "
            f"{root.accumulation_dtype or wider[0].dtype}, narrower than gradient_manager.grad_dtype "
            f"{grad_sync.grad_dtype!r}; set fsdp.reduce_dtype to it, or reduce_every: microbatch"
        )
    if not root.config.reduces_once_per_step(root.gathered_bytes, grad_dtype_wider=bool(wider)):
        if wider and root.config.reduces_once_per_step(root.gathered_bytes, grad_dtype_wider=False):
            logger.info(
                "fsdp reduce_every auto: every microbatch, so that the gradient synchronizer accumulates in "
                "gradient_manager.grad_dtype %r (FSDP would in %s); set fsdp.reduce_dtype to it to reduce "
                "once per step",
                grad_sync.grad_dtype,
                root.accumulation_dtype or wider[0].dtype,
            )
        return None
    logger.info(
        "fsdp reduce_every %s: the units stay gathered through the step's %d microbatches and their "
        "gradients are reduced once, in the last microbatch's backward",
        root.config.reduce_every,
        microbatches,
    )
    return sharding


class PipelinedStepRunner:
    """The local stages run the pipeline program; the loss is computed where the last stage lives."""

    def __init__(
        self,
        executor: PipelineExecutor,
        task: TrainTask,
        device: torch.device,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        self.executor = executor
        self.task = task
        self.device = device
        self.metrics = metrics or {}
        self.loss_pp_rank = executor.loss_rank

    def forward_backward(self, microbatches: Sequence[PyTree]) -> tuple[torch.Tensor, torch.Tensor]:
        def loss_fn(outputs: Any, microbatch: int) -> LossOutput:
            loss = self.task.compute_loss(outputs, microbatches[microbatch])
            if self.metrics:
                with torch.no_grad():
                    self.task.update_metrics(self.metrics, outputs, microbatches[microbatch], loss)
            return loss

        inputs = [self.task.forward_inputs(mb) for mb in microbatches]
        result = self.executor.train_step(inputs, loss_fn)
        if result.loss_sum is None or result.weight is None:
            zero = torch.zeros((), dtype=torch.float64, device=self.device)
            return zero, zero.clone()
        return result.loss_sum.detach().double(), result.weight.detach().double()


class ContextShardedStepRunner:
    """Context parallelism: every microbatch is split over the cp ranks (`d9d.parallel.context`) before the
    wrapped runner, its task and its model see it, so each rank's loss and loss weight cover its own tokens
    and `global_loss` counts every token once."""

    def __init__(self, inner: StepRunner, cp: ContextParallelGroup) -> None:
        self.inner = inner
        self.cp = cp
        self.loss_pp_rank = inner.loss_pp_rank

    def forward_backward(self, microbatches: Sequence[PyTree]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.forward_backward([shard_for_context(mb, self.cp) for mb in microbatches])


def shard_for_context(microbatch: PyTree, cp: ContextParallelGroup) -> dict[str, Any]:
    if not isinstance(microbatch, Mapping):
        raise TypeError(
            f"context parallelism splits mapping microbatches (input_ids, labels, ...), got "
            f"{type(microbatch).__name__}"
        )
    return shard_microbatch(microbatch, cp)


class SynchronizedGradientReducer:
    """Data-parallel gradients: the synchronizer reduces buckets during backward; `finish` waits and scales.

    The engine already knows the global loss weight (summed over every rank that computes a loss, pipeline
    stages included), so the synchronizer is given that total and only divides by it.
    """

    def __init__(self, synchronizer: GradientSynchronizer) -> None:
        self.synchronizer = synchronizer

    def finish(self, global_weight: torch.Tensor | None) -> None:
        self.synchronizer.wait(global_weight)


def build_gradient_reducer(
    stages: Sequence[tuple[nn.Module, torch.optim.Optimizer]],
    config: GradSyncConfig,
    num_microbatches: int,
    once_per_step: Collection[torch.Tensor] = (),
) -> GradientReducer:
    """Use the synchronizer when any gradient is summed over more than one rank or accumulated in a wider
    dtype than its parameter's (`config.grad_dtype`, a strategy's reduce dtype), else a local scale.

    `stages`: each local stage with its optimizer (`PipelinedOptimizer.pair_with`); `once_per_step`: the
    parameters whose gradient arrives once per step (`PipelineExecutor.reduced_once_per_step`)."""
    synced = [sp for m, o in stages for sp in collect_synced_params(m, o)]

    def needs_synchronizer(sp: SyncedParam) -> bool:
        if sp.reduce_mesh is not None and sp.reduce_mesh.size() > 1:
            return True
        dtype = config.resolve_grad_dtype(sp.param.dtype)
        return dtype != sp.param.dtype or (
            sp.reduce_dtype is not None and torch.promote_types(dtype, sp.reduce_dtype) != dtype
        )

    if any(needs_synchronizer(sp) for sp in synced):
        return SynchronizedGradientReducer(
            GradientSynchronizer(
                synced, config, num_microbatches=num_microbatches, once_per_step=once_per_step
            )
        )
    return LocalGradientReducer(sp.param for sp in synced)


class LocalGradientReducer:
    """No data parallelism: gradients are complete after backward and only need the weight division."""

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]

    def finish(self, global_weight: torch.Tensor | None) -> None:
        grads = [local_tensor(p.grad) for p in self.parameters if p.grad is not None]
        if not grads or global_weight is None:
            return
        # Used where the optimizer cannot divide (not fused Adam). The scale stays on the device: reading it
        # to the host for `_foreach_mul_`'s Python-scalar fast path exposed the host work after backward and
        # cost more than it saved (one H200). The float32 reciprocal equals the Python float's rounding:
        # results are bitwise `grad.mul_(1 / weight)`.
        with torch.no_grad():
            scale_(grads, global_weight.reciprocal().to(torch.float32))


def processed_positions(microbatches: Sequence[PyTree]) -> float:
    """The positions of a step's microbatches the model computes on (padding excluded), as the collators
    mark them: the non-zero entries of a microbatch's `attention_mask` (0 on padding), else its
    `segment_ids` >= 0 (packed rows: -1 on padding), else every position of its `input_ids`. NaN when a
    microbatch has none of them (a plug-in's batch: the throughput is then not reported rather than
    guessed). Counted on the batches as the data provider gives them, host tensors, before they move to the
    device: no device work, no synchronization."""
    total = 0
    for microbatch in microbatches:
        keys = microbatch if isinstance(microbatch, Mapping) else {}
        mask, segments, ids = (keys.get(k) for k in ("attention_mask", "segment_ids", "input_ids"))
        if isinstance(mask, torch.Tensor):
            total += int(torch.count_nonzero(mask))
        elif isinstance(segments, torch.Tensor):
            total += int(torch.count_nonzero(segments >= 0))
        elif isinstance(ids, torch.Tensor):
            total += ids.numel()
        else:
            return math.nan
    return float(total)


def counts_positions(ctx: DistributedContext, loss_pp_rank: int) -> bool:
    """Whether this rank's `processed_positions` enter the step's global count: one rank per distinct batch.
    Data-parallel ranks hold different batches; pipeline, context- and tensor-parallel ranks get copies of
    their data-parallel rank's (counted before the context-parallel split), so pipeline rank `loss_pp_rank`
    and cp 0 count (tp 0: `global_loss` drops the other tp ranks' share)."""
    if not ctx.is_distributed:
        return True
    coords = ctx.coordinates(MeshDomain.BATCH)
    return coords["pp"] == loss_pp_rank and coords["cp"] == 0


def global_loss(
    ctx: DistributedContext,
    loss_sum: torch.Tensor,
    weight: torch.Tensor,
    exchange_overflow: torch.Tensor | None = None,
    positions: float | None = None,
) -> torch.Tensor:
    """[loss sum, weight] (float64) summed over every rank that computes a distinct loss; with
    `exchange_overflow` (this rank's 0/1 flag, `d9d.engine.exchange`) a third element, the number of ranks
    whose expert exchange overflowed; with `positions` (this rank's share of the step's processed positions,
    `processed_positions` where `counts_positions`, else 0) a last element, their global sum — in the same
    all-reduce, so neither costs a collective of its own.

    Runners return zeros where no loss is computed (pipeline ranks without the last stage), and
    tensor-parallel ranks compute the same loss, so only tp coordinate 0 contributes. Context-parallel ranks
    hold disjoint tokens of each sequence (`ContextShardedStepRunner`), so their sums add up to each token
    once.
    """
    totals = torch.stack([loss_sum, weight]).double()
    # a host count becomes a device value through a fill: no host-to-device copy, which would synchronize
    counted = (
        None if positions is None else torch.full((1,), positions, dtype=totals.dtype, device=totals.device)
    )
    if ctx.is_distributed and ctx.coordinates(MeshDomain.REGULAR)["tp"] != 0:
        totals = torch.zeros_like(totals)
        counted = None if counted is None else torch.zeros_like(counted)
    if exchange_overflow is not None:  # every rank's own exchange, tp ranks included
        totals = torch.cat([totals, exchange_overflow.to(totals).reshape(1)])
    if counted is not None:
        totals = torch.cat([totals, counted])
    if ctx.is_distributed:
        dist.all_reduce(totals)
    return totals


class GradientClipper:
    """The global gradient norm over every stage (pipeline ranks included), clipped to `max_norm` unless
    that is None. The norm is computed either way: the non-finite guard checks it (`d9d.engine.nonfinite`)."""

    def __init__(
        self, ctx: DistributedContext, parameters: list[nn.Parameter], max_norm: float | None
    ) -> None:
        self.parameters = parameters
        self.max_norm = max_norm
        self.pp_group: dist.ProcessGroup | None = None
        if ctx.is_distributed and ctx.params.pipeline_parallel > 1:
            self.pp_group = ctx.mesh_for(MeshDomain.REGULAR).get_group("pp")

    def clip(self, divisor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the gradient norm before clipping, the divisor left to the optimizer), on the device (the loop
        reads the norm with the loss). Every rank calls it, with or without parameters of its own: the norm
        is a collective over pp.

        Without `divisor` the gradients are final: clipping scales them in place, and no divisor is left.
        With it they are `divisor` times the true ones (the optimizer divides them): the norm is theirs
        divided by it, and clipping folds its coefficient into the divisor returned instead of touching
        every gradient."""
        if divisor is None:
            if self.max_norm is None:
                return global_grad_norm(self.parameters, pp_group=self.pp_group), None
            return clip_grad_norm_(self.parameters, self.max_norm, pp_group=self.pp_group), None
        norm = global_grad_norm(self.parameters, pp_group=self.pp_group) / divisor
        if self.max_norm is None:
            return norm, divisor
        return norm, divisor / clip_coefficient(norm, self.max_norm)


def data_group(ctx: DistributedContext) -> dist.ProcessGroup | None:
    """The ranks that see different data (dp, and cp when the sequence is split): task metrics sync here."""
    if not ctx.is_distributed:
        return None
    batch = ctx.mesh_for(MeshDomain.BATCH)
    if ctx.params.context_parallel == 1:
        return batch.get_group("dp")
    return batch["dp", "cp"]._flatten().get_group()


def to_device(microbatch: PyTree, device: torch.device, pin_memory: bool) -> PyTree:
    if device.type == "cpu":
        return microbatch
    if pin_memory:
        microbatch = tree_map_tensors(lambda t: t.pin_memory(), microbatch)
    return tree_to(microbatch, device, non_blocking=True)
