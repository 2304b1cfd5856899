"""Validation loss and perplexity during training, on a fixed held-out set.

The `eval:` section names a data provider (the same shape as `data:`), how many batches of how many samples
make up the eval set, and how often to run it. The set is the first `batches × batch_size` samples of that
provider's global order, dealt over the data-parallel ranks like training data: every evaluation resets the
provider to its initial state, so it reads the same samples, and the result at step k depends only on the
weights at step k. That is what makes it exact across restarts (nothing eval-related is checkpointed: a
resumed run evaluates the same set with the same weights) and independent of when it last ran.

Loss = Σ token losses / Σ target tokens over the whole set (the training task's `compute_loss`), reduced
over every rank that holds a distinct part (dp, and cp when the sequence is split), as the training loss is;
perplexity = exp(loss). Reported from global rank 0 as `eval/loss`, `eval/perplexity`, `eval/tokens`
(a `MetricPoint` of kind "eval"), so they reach the tracker and the client stream.

Pipeline parallelism is refused at config validation (`TrainConfig`): the training pipeline schedule runs
backward passes, and no forward-only schedule is wired here yet.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.engine.components import build_data
from d9d.engine.config import EvalConfig
from d9d.engine.providers import DataProvider, DataSetup, TrainTask
from d9d.engine.runtime import MetricPoint, RunReporter
from d9d.engine.step import global_loss, to_device


class Evaluator:
    def __init__(
        self,
        config: EvalConfig,
        ctx: DistributedContext,
        reporter: RunReporter,
        task: TrainTask,
        modules: tuple[nn.Module, ...],
        *,
        seed: int,
        pin_memory: bool,
    ) -> None:
        dp = ctx.params.data_parallel
        if config.batch_size % dp != 0:
            raise ValueError(
                f"eval.batch_size={config.batch_size} is not divisible by the data-parallel degree {dp}"
            )
        if len(modules) != 1:
            raise ValueError("evaluation runs one local stage; pipeline-parallel eval is not supported")
        self.config = config
        self.ctx = ctx
        self.reporter = reporter
        self.task = task
        self.module = modules[0]
        self.pin_memory = pin_memory
        self.data: DataProvider = build_data(config.data, "eval.data")
        self.data.setup(
            DataSetup(
                dp_rank=ctx.coordinates(MeshDomain.BATCH)["dp"],
                dp_size=dp,
                microbatch_size=config.batch_size // dp,
                gradient_accumulation=1,
                global_batch_size=config.batch_size,
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

    @torch.no_grad()
    def evaluate(self, step: int) -> dict[str, float]:
        """Run the eval set through the model; report and return loss, perplexity and token count."""
        self.data.load_state_dict(self._start)
        was_training = self.module.training
        self.module.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        weight = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        try:
            for batch_number in range(self.config.batches):
                microbatches = self.data.next_step()
                if not microbatches:
                    raise RuntimeError(
                        f"eval.data ran out after {batch_number} of eval.batches={self.config.batches} "
                        "batches; lower eval.batches or eval.batch_size, or use a larger eval set"
                    )
                for microbatch in microbatches:
                    microbatch = to_device(microbatch, self.ctx.device, self.pin_memory)
                    outputs = self.module(**self.task.forward_inputs(microbatch))
                    loss = self.task.compute_loss(outputs, microbatch)
                    loss_sum += loss.loss_sum.detach().double()
                    weight += loss.weight.detach().double()
        finally:
            self.module.train(was_training)
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
