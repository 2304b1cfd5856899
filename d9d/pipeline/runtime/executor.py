"""Runs this rank's part of a pipeline program for one step.

The executor walks its action list in order. A run of consecutive transfers is posted as one batch of async
P2P operations per channel; a compute action first waits for the receives it consumes. Received tensors go to
a mailbox keyed by (kind, stage, microbatch), where stages on the same rank also hand over their outputs
without communication. Sends are waited for at the end of the step.

Loss: the last stage calls `loss_fn(outputs, microbatch)`, which returns the microbatch's summed loss and its
weight (e.g. its number of target tokens). The backward starts from `loss_sum × loss_scale`. With the default
scale of 1, `.grad` accumulates the gradient of the plain sum over microbatches; the engine keeps that default
and divides by W, the weight summed over all microbatches and data-parallel ranks, once the step's backward is
done (its gradient reducer), which gives the gradient of the weighted mean loss of the global batch whatever
the split into microbatches. A caller that knows W before the step may pass `loss_scale = 1 / W` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.runtime.channels import P2PChannels
from d9d.pipeline.runtime.metadata import MetadataExchange, StageMetas
from d9d.pipeline.runtime.protocols import PipelineLossFn, PipelineOutputFn
from d9d.pipeline.runtime.sharding import StageSharding
from d9d.pipeline.runtime.stage import StageRuntime, is_differentiable
from d9d.pipeline.schedule.actions import Compute, ComputeKind, Direction, Recv, Send, Transfer, compute_parts
from d9d.pipeline.schedule.program import PipelineProgram, comm_batches

MicrobatchInputs = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """Loss totals of the step; set on the rank holding the last stage only (None elsewhere)."""

    loss_sum: torch.Tensor | None
    weight: torch.Tensor | None
    microbatch_losses: list[tuple[torch.Tensor, torch.Tensor]]
    """(loss_sum, weight) of each microbatch, detached, in microbatch order."""


@dataclass
class _Batch:
    """The works of one posted P2P batch, waited for once (a second wait on a gloo receive blocks forever)."""

    works: list[dist.Work]

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


@dataclass
class _Received:
    tensors: dict[str, torch.Tensor]
    batch: _Batch | None = None


@dataclass
class _Step:
    metas: StageMetas
    microbatches: Sequence[MicrobatchInputs]
    loss_fn: PipelineLossFn | None
    output_fn: PipelineOutputFn | None
    loss_scale: float
    mailbox: dict[tuple[str, int, int], _Received] = field(default_factory=dict)
    outbox: dict[Transfer, dict[str, torch.Tensor]] = field(default_factory=dict)
    sends: list[tuple[_Batch, list[torch.Tensor]]] = field(default_factory=list)
    losses: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sharding: dict[int, StageSharding] = field(default_factory=dict)
    finished_backwards: dict[int, int] = field(default_factory=dict)
    """Stage -> microbatches whose backward (full, or the weight pass) is done."""


class PipelineExecutor:
    """Executes `program` for pipeline rank `pp_rank`, which holds `stages` (stage index -> module)."""

    def __init__(
        self,
        program: PipelineProgram,
        stages: Mapping[int, nn.Module],
        *,
        pp_rank: int,
        device: torch.device,
        channels: P2PChannels | None = None,
        pp_group: dist.ProcessGroup | None = None,
    ) -> None:
        expected = program.placement.stages_of(pp_rank)
        if sorted(stages) != list(expected):
            raise ValueError(
                f"pipeline rank {pp_rank} must hold stages {list(expected)} under {program.name}, got "
                f"{sorted(stages)}"
            )
        if program.num_ranks > 1 and (channels is None or pp_group is None):
            raise ValueError(f"a {program.num_ranks}-rank program needs P2P channels and the pipeline group")
        self.program = program
        self.pp_rank = pp_rank
        self.device = device
        self._runtimes = {
            s: StageRuntime(stages[s], PipelineStageInfo(s, program.num_stages)) for s in expected
        }
        self._channels = channels
        self._pp_group = pp_group
        self._metas = MetadataExchange(list(self._runtimes.values()), pp_group)

    def _stage_sharding(self) -> dict[int, StageSharding]:
        """The FSDP-sharded local stages, looked up when asked (a stage may be sharded after the executor
        was made)."""
        found = {s: StageSharding.of(r.module) for s, r in self._runtimes.items()}
        return {s: sharding for s, sharding in found.items() if sharding is not None}

    def reduced_once_per_step(self) -> list[torch.Tensor]:
        """Parameters whose gradients are reduced once per training step (FSDP-sharded stages), not once per
        microbatch: a gradient synchronizer counts one accumulation for them (see `runtime.sharding`)."""
        return [p for sharding in self._stage_sharding().values() for p in sharding.reduced_params()]

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step: how many times each parameter's `.grad` is accumulated in a step."""
        return self.program.num_microbatches

    @property
    def stages(self) -> dict[int, nn.Module]:
        return {s: r.module for s, r in self._runtimes.items()}

    @property
    def loss_rank(self) -> int:
        """Pipeline rank computing the loss: the holder of the last stage (rank 0 under V schedules)."""
        return self.program.placement.rank_of(self.program.num_stages - 1)

    def share_loss(self, result: StepResult) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss_sum, weight) of the step on every pipeline rank: a broadcast from `loss_rank`."""
        values = torch.zeros(2, dtype=torch.float64, device=self.device)
        if result.loss_sum is not None and result.weight is not None:
            values[0], values[1] = result.loss_sum.double(), result.weight.double()
        if self._pp_group is not None:
            src = dist.get_global_rank(self._pp_group, self.loss_rank)
            dist.broadcast(values, src=src, group=self._pp_group)
        return values[0], values[1]

    def train_step(
        self, microbatches: Sequence[MicrobatchInputs], loss_fn: PipelineLossFn, *, loss_scale: float = 1.0
    ) -> StepResult:
        """Forward and backward every microbatch; gradients accumulate into `.grad` (see module docs)."""
        if not self.program.training:
            raise ValueError(f"{self.program.name} is a forward-only program; use forward_step")
        step = self._run(microbatches, loss_fn, None, loss_scale)
        losses = [step.losses[mb] for mb in sorted(step.losses)]
        if not losses:
            return StepResult(None, None, [])
        return StepResult(
            torch.stack([lo for lo, _ in losses]).sum(), torch.stack([w for _, w in losses]).sum(), losses
        )

    def forward_step(self, microbatches: Sequence[MicrobatchInputs], output_fn: PipelineOutputFn) -> None:
        """Forward only; the last stage hands each microbatch's outputs to `output_fn`."""
        if self.program.training:
            raise ValueError(f"{self.program.name} is a training program; use train_step")
        self._run(microbatches, None, output_fn, 1.0)

    def _run(
        self,
        microbatches: Sequence[MicrobatchInputs],
        loss_fn: PipelineLossFn | None,
        output_fn: PipelineOutputFn | None,
        loss_scale: float,
    ) -> _Step:
        if len(microbatches) != self.num_microbatches:
            raise ValueError(
                f"the {self.program.name} program was built for {self.num_microbatches} microbatches, got "
                f"{len(microbatches)}"
            )
        step = _Step(self._metas.metas(microbatches), microbatches, loss_fn, output_fn, loss_scale)
        if self.program.training:
            step.sharding = self._stage_sharding()
            for sharding in step.sharding.values():
                sharding.begin_step()
        for _, item in comm_batches(self.program.actions[self.pp_rank]):
            if isinstance(item, list):
                self._post(step, item)
            else:
                for part in compute_parts(item):
                    self._compute(step, part)
        for batch, _ in step.sends:
            batch.wait()
        if step.mailbox or step.outbox:
            leftovers = sorted(map(str, step.mailbox)) + sorted(map(str, step.outbox))
            raise RuntimeError(f"pipeline rank {self.pp_rank}: tensors never consumed: {leftovers}")
        for runtime in self._runtimes.values():
            runtime.check_drained()
        unreduced = sorted(s for s, sharding in step.sharding.items() if sharding.in_step)
        if unreduced:
            raise RuntimeError(
                f"pipeline rank {self.pp_rank}: stages {unreduced} never finished their backward"
            )
        return step

    # -- communication ------------------------------------------------------------------------------

    def _post(self, step: _Step, actions: list[Send | Recv]) -> None:
        assert self._channels is not None
        per_channel: dict[tuple[bool, int], list[tuple[Send | Recv, list[torch.Tensor]]]] = {}
        for action in actions:
            if isinstance(action, Send):
                tensors = list(step.outbox.pop(action.transfer).values())
            else:
                received = self._buffers(step, action.transfer)
                step.mailbox[_delivered(action.transfer)] = _Received(received)
                tensors = list(received.values())
            per_channel.setdefault((isinstance(action, Send), action.peer), []).append((action, tensors))
        for (is_send, peer), items in per_channel.items():
            ops = [
                self._channels.op(is_send, t.contiguous() if is_send else t, self.pp_rank, peer)
                for _, tensors in items
                for t in tensors
            ]
            posted = _Batch([w for w in dist.batch_isend_irecv(ops) if w is not None] if ops else [])
            if is_send:
                step.sends.append((posted, [op.tensor for op in ops]))
            else:
                for action, _ in items:
                    step.mailbox[_delivered(action.transfer)].batch = posted

    def _buffers(self, step: _Step, transfer: Transfer) -> dict[str, torch.Tensor]:
        if transfer.direction is Direction.FORWARD:
            metas = step.metas[transfer.src_stage][transfer.microbatch]
        else:  # gradients of our own stage's outputs, for those that carry gradients
            metas = {
                n: m
                for n, m in step.metas[transfer.dst_stage][transfer.microbatch].items()
                if is_differentiable(m.dtype)
            }
        return {n: torch.empty(m.shape, dtype=m.dtype, device=self.device) for n, m in metas.items()}

    def _take(self, step: _Step, key: tuple[str, int, int]) -> dict[str, torch.Tensor]:
        received = step.mailbox.pop(key)
        if received.batch is not None:
            received.batch.wait()
        return received.tensors

    # -- compute ------------------------------------------------------------------------------------

    def _compute(self, step: _Step, part: Compute) -> None:
        s, mb = part.stage, part.microbatch
        runtime = self._runtimes[s]
        last = self.program.num_stages - 1
        if part.kind is ComputeKind.FORWARD:
            received = self._take(step, ("act", s, mb)) if s > 0 else {}
            outputs, loss = runtime.forward(
                mb,
                step.microbatches[mb],
                received,
                loss_fn=step.loss_fn,
                output_fn=step.output_fn,
                loss_scale=step.loss_scale,
            )
            if loss is not None:
                step.losses[mb] = (loss.loss_sum.detach(), loss.weight.detach())
            if s < last:
                self._hand_over(step, Transfer(Direction.FORWARD, s, mb), outputs)
        elif part.kind is ComputeKind.BACKWARD_WEIGHT:
            runtime.backward_weight(mb)
            self._backward_done(step, s)
        else:
            grads = self._take(step, ("grad", s, mb)) if s < last else None
            split = part.kind is ComputeKind.BACKWARD_INPUT
            input_grads = runtime.backward(mb, grads, split=split)
            if s > 0:
                self._hand_over(step, Transfer(Direction.BACKWARD, s, mb), input_grads)
            if not split:
                self._backward_done(step, s)

    def _backward_done(self, step: _Step, stage: int) -> None:
        """After a microbatch's last backward pass on `stage`: once every microbatch's is done, reduce the
        stage's FSDP gradients (asynchronous on CUDA: it overlaps what the rank does next)."""
        done = step.finished_backwards[stage] = step.finished_backwards.get(stage, 0) + 1
        sharding = step.sharding.get(stage)
        if sharding is not None and done == self.num_microbatches:
            sharding.reduce()

    def _hand_over(self, step: _Step, transfer: Transfer, tensors: dict[str, torch.Tensor]) -> None:
        if self.program.placement.rank_of(transfer.dst_stage) == self.pp_rank:
            step.mailbox[_delivered(transfer)] = _Received(tensors)
        else:
            step.outbox[transfer] = tensors


def _delivered(transfer: Transfer) -> tuple[str, int, int]:
    kind = "act" if transfer.direction is Direction.FORWARD else "grad"
    return (kind, transfer.dst_stage, transfer.microbatch)
