"""Validation loss and perplexity during training, on a fixed held-out set.

The `eval:` section names a data provider (the same shape as `data:`), how many batches of how many samples
make up the eval set, and how often to run it. The set is the first `batches × batch_size` samples of that
provider's global order, dealt over the data-parallel ranks like training data (the provider is set up with
one microbatch of `batch_size / dp` samples per batch and `batches` microbatches per step, and one evaluation
reads one step): every evaluation resets the provider to its initial state, so it reads the same samples,
and the result at step k depends only on the weights at step k. That is what makes it exact across
restarts (nothing eval-related is checkpointed: a resumed run evaluates the same set with the same weights)
and independent of when it last ran.

Loss = Σ token losses / Σ target tokens over the whole set (the training task's `compute_loss`), reduced
over every rank that holds a distinct part (dp; pipeline ranks without the loss add zeros), as the training
loss is;
perplexity = exp(loss). Reported from global rank 0 as `eval/loss`, `eval/perplexity`, `eval/tokens`
(a `MetricPoint` of kind "eval"), so they reach the tracker and the client stream.

With pipeline parallelism the eval set runs through the training stages under a forward-only schedule
(`InferenceSchedule`, all `batches` microbatches in flight) whose placement must be the training schedule's:
looped schedules (1f1b, gpipe, zb1p, interleaved_1f1b) qualify, V schedules (zbv, dualpipev) are refused at
config validation (`TrainConfig`), as is context parallelism (eval batches are not split over the sequence).

Under `compile.mode: reduce-overhead` the blocks run without gradients here, which inductor compiles and
graphs apart from training. Each eval forward is a step of the graph trees of its own (`begin_step` before
each microbatch, before the whole forward-only schedule under pipelining): a microbatch's outputs are
consumed (its loss summed) before the next starts, so every microbatch replays the same graphs instead of
recording a graph per position in the eval set.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.core.types import PyTree
from d9d.engine.components import build_data
from d9d.engine.config import EvalConfig
from d9d.engine.providers import DataProvider, DataSetup, TrainTask
from d9d.engine.runtime import MetricPoint, RunReporter
from d9d.engine.stages import Stages
from d9d.engine.step import global_loss, to_device
from d9d.parallel.compile import begin_step
from d9d.pipeline.runtime.executor import PipelineExecutor
from d9d.pipeline.schedule.config import InferenceSchedule
from d9d.pipeline.setup import PipelineSetup


class Evaluator:
    """Built on every rank at the same point (with pipelining it creates the forward-only schedule's
    communication groups, a collective)."""

    def __init__(
        self,
        config: EvalConfig,
        ctx: DistributedContext,
        reporter: RunReporter,
        task: TrainTask,
        stages: Stages,
        *,
        seed: int,
        pin_memory: bool,
    ) -> None:
        dp = ctx.params.data_parallel
        if config.batch_size % dp != 0:
            raise ValueError(
                f"eval.batch_size={config.batch_size} is not divisible by the data-parallel degree {dp}"
            )
        self.config = config
        self.ctx = ctx
        self.reporter = reporter
        self.task = task
        self.stages = stages
        self.pin_memory = pin_memory
        self.executor: PipelineExecutor | None = None
        if ctx.params.pipeline_parallel > 1:
            schedule = InferenceSchedule(stages_per_rank=len(stages.modules))
            setup = PipelineSetup.create(ctx, schedule, config.batches)
            if setup.local_stages != list(stages.infos):
                placed = [i.current_stage for i in setup.local_stages]
                trained = [i.current_stage for i in stages.infos]
                raise ValueError(
                    f"the forward-only eval schedule places stages {placed} on this rank, training {trained}"
                )
            self.executor = setup.executor(stages.by_index)
        self.data: DataProvider = build_data(config.data, "eval.data")
        self.data.setup(
            DataSetup(
                dp_rank=ctx.coordinates(MeshDomain.BATCH)["dp"],
                dp_size=dp,
                microbatch_size=config.batch_size // dp,
                gradient_accumulation=config.batches,
                global_batch_size=config.batch_size * config.batches,
                seed=seed,
            )
        )
        # a copy: the provider may hand out its live state objects
        self._start: Mapping[str, Any] = copy.deepcopy(self.data.state_dict())
        self.last_step: int | None = None

    def due(self, step: int, *, final: bool) -> bool:
        if step == self.last_step:
            return False
        if final:
            return self.config.at_end
        period = self.config.period
        return period is not None and step % period == 0

    def _microbatches(self) -> list[PyTree]:
        self.data.load_state_dict(self._start)
        microbatches = self.data.next_step()
        # Every rank must run the same number of forwards (under FSDP, expert or tensor parallelism each
        # is a sequence of collectives), so the ranks compare counts first and all refuse together: a rank
        # that refused alone would leave the others waiting in the all-gathers of their next forward.
        counts = torch.tensor([-float(len(microbatches)), float(len(microbatches))])
        if self.ctx.is_distributed:
            dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        fewest, most = -int(counts[0].item()), int(counts[1].item())
        if fewest != self.config.batches or most != self.config.batches:
            raise RuntimeError(
                f"eval.data gave {len(microbatches)} of eval.batches={self.config.batches} batches on this "
                f"rank ({fewest} to {most} over the ranks; a finite eval set ran out?); lower eval.batches "
                "or eval.batch_size, or use a larger eval set"
            )
        return [to_device(mb, self.ctx.device, self.pin_memory) for mb in microbatches]

    def _local_loss(self, microbatches: list[PyTree]) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss sum and weight of this rank's microbatches (zeros on pipeline ranks without the loss)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        weight = torch.zeros((), dtype=torch.float64, device=self.ctx.device)

        def add(outputs: Any, microbatch: int) -> None:
            nonlocal loss_sum, weight
            loss = self.task.compute_loss(outputs, microbatches[microbatch])
            loss_sum = loss_sum + loss.loss_sum.detach().double()
            weight = weight + loss.weight.detach().double()

        inputs = [self.task.forward_inputs(mb) for mb in microbatches]
        reports = self.stages.compile_reports
        if self.executor is not None:
            begin_step(reports)  # every microbatch in flight at once: one graph step
            self.executor.forward_step(inputs, add)
        else:
            for microbatch, kwargs in enumerate(inputs):
                begin_step(reports)
                add(self.stages.modules[0](**kwargs), microbatch)
        return loss_sum, weight

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Run the eval set through the model; report and return loss, perplexity and token count."""
        microbatches = self._microbatches()
        modes = [m.training for m in self.stages.modules]
        for module in self.stages.modules:
            module.eval()
        try:
            loss_sum, weight = self._local_loss(microbatches)
        finally:
            for module, mode in zip(self.stages.modules, modes, strict=True):
                module.train(mode)
        totals = global_loss(self.ctx, loss_sum, weight)
        total_loss, tokens = float(totals[0]), float(totals[1])
        if tokens <= 0:
            raise RuntimeError(f"step {step}: the eval set has no target tokens")
        mean = total_loss / tokens
        values = {"eval/loss": mean, "eval/perplexity": math.exp(mean), "eval/tokens": tokens}
        self.last_step = step
        if self.ctx.is_main_process:
            self.reporter.metrics(MetricPoint(step, 0, values, kind="eval", wall_time=time.time()))
            self.ctx.logger.info(
                "step %d: eval loss %.4f, perplexity %.3f", step, mean, values["eval/perplexity"]
            )
        return values
