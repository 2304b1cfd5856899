"""The per-rank training loop.

Lifecycle (see docs/engine.md): context → seeds → task → event bus → data → model stages (meta build,
parallelize, materialize, initialize) → gradient reducer → optimizers/LR → checkpointer → resume → loop
(commands → microbatches → forward/backward → reduce + scale → clip → optimizer/LR step → report →
checkpoint) → finish. Every dependency is built from the config by one function here and handed to the
loop; the loop itself knows nothing about which parallelism is in use.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.core.pytree import tree_map_tensors, tree_to
from d9d.core.types import PyTree
from d9d.determinism import (
    RankSeeds,
    capture_rng_state,
    parameter_init_rng,
    restore_rng_state,
    seed_everything,
)
from d9d.engine.checkpoint import Checkpointer
from d9d.engine.config import TrainConfig
from d9d.engine.events import (
    CheckpointSaved,
    EventBus,
    ForwardBackwardFinished,
    OptimizerStepFinished,
    StepFinished,
    StepStarted,
    TrainingFinished,
)
from d9d.engine.progress import StepProgress
from d9d.engine.providers import DataProvider, DataSetup, ModelProvider, TrainTask
from d9d.engine.registry import build_component
from d9d.engine.runtime import Command, CommandKind, MetricPoint, RankResult, RunReporter
from d9d.engine.step import (
    GradientReducer,
    PipelinedStepRunner,
    SequentialStepRunner,
    StepRunner,
    build_gradient_reducer,
)
from d9d.metrics import AsyncMetricCollector, ComposeMetric, to_scalars
from d9d.parallel import clip_grad_norm_
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.setup import PipelineSetup
from d9d.profiling import NullProfiler, StepHook, StepProfiler


@dataclass
class TrainState:
    """Global (not per-microbatch) state of the loop; what the checkpoint's engine state holds."""

    step: int = 0
    losses: list[float] = field(default_factory=list)


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        ctx: DistributedContext,
        reporter: RunReporter,
        events: EventBus | None = None,
    ) -> None:
        self.config = config
        self.ctx = ctx
        self.reporter = reporter
        self.events = events or EventBus()
        self.state = TrainState()
        self._stop_requested = False
        self._checkpoint_requested = False

    # -- setup --------------------------------------------------------------------------------------

    def setup(self) -> None:
        c = self.config
        ctx = self.ctx
        ctx.set_timeout(timedelta(seconds=c.timeouts.init_s))
        self.seeds = RankSeeds.for_rank(ctx.params, ctx.rank, c.determinism.seed)
        self.task: TrainTask = build_component("task", c.task, "task")
        self.dp_size = ctx.params.data_parallel
        self.dp_rank = ctx.coordinates(MeshDomain.BATCH)["dp"]
        self.grad_accumulation = c.batching.gradient_accumulation(self.dp_size)
        self.data: DataProvider = build_component("data", c.data, "data")
        self.data.setup(
            DataSetup(
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                microbatch_size=c.batching.microbatch_size,
                gradient_accumulation=self.grad_accumulation,
                global_batch_size=c.batching.global_batch_size,
                seed=c.determinism.seed,
            )
        )
        self.model_provider: ModelProvider = build_component("model", c.model, "model")
        self.modules = self._build_stages()
        seed_everything(self.seeds.activations)
        # Values that event subscribers (e.g. MoE load balancing) record during a step, logged with it.
        self.step_metrics: dict[str, float] = {}
        subscribe = getattr(self.model_provider, "subscribe", None)
        if subscribe is not None:
            subscribe(self.events, self.modules, ctx, self.step_metrics)
        optimizer_provider = build_component("optimizer", c.optimizer, "optimizer")
        self.optimizers: list[torch.optim.Optimizer] = [
            optimizer_provider.build(m.parameters(), seed=self.seeds.parameters) for m in self.modules
        ]
        self.reducer: GradientReducer = build_gradient_reducer(
            self.modules, self.optimizers, c.gradient_manager, self.grad_accumulation
        )
        self.schedulers: list[torch.optim.lr_scheduler.LRScheduler] = []
        if c.lr_scheduler is not None:
            scheduler_provider = build_component("lr_scheduler", c.lr_scheduler, "lr_scheduler")
            self.schedulers = [scheduler_provider.build(o, c.trainer.total_steps) for o in self.optimizers]
        self.metrics = self.task.create_metrics()
        self.metric_collector: AsyncMetricCollector[Any] | None = None
        if self.metrics:
            # Synced over the ranks that see different data; computed on a side thread so steps don't wait.
            self.metric_collector = AsyncMetricCollector(
                ComposeMetric(self.metrics), group=self._data_group()
            )
        self.runner: StepRunner
        if self.pipeline is not None:
            executor = self.pipeline.executor(
                {info.current_stage: m for info, m in zip(self.stage_infos, self.modules, strict=True)}
            )
            self.runner = PipelinedStepRunner(executor, self.task, ctx.device, self.metrics)
        else:
            self.runner = SequentialStepRunner(self.modules[0], self.task, ctx.device, self.metrics)
        self.checkpointer = Checkpointer(
            ctx, c.checkpoint_dir, self.reporter, trainable_only=c.checkpointing.trainable_only
        )
        self._resume()

    def _build_stages(self) -> list[nn.Module]:
        """Build this rank's stages on meta, shard, materialize, initialize (one stage without pipelining)."""
        self.pipeline: PipelineSetup | None = None
        infos = [PipelineStageInfo()]
        if self.ctx.params.pipeline_parallel > 1:
            self.pipeline = PipelineSetup.create(self.ctx, self.config.schedule, self.grad_accumulation)
            infos = self.pipeline.local_stages
        self.stage_infos = infos
        modules = []
        for info in infos:
            with torch.device("meta"):
                module = self.model_provider.build_stage(info)
            self.model_provider.parallelize(module, self.ctx)
            module.to_empty(device=self.ctx.device)
            with torch.no_grad(), parameter_init_rng(self.seeds.parameters, self._stage_mesh()):
                self.model_provider.initialize(module, self.ctx)
            module.train()
            modules.append(module)
        return modules

    def _stage_mesh(self) -> DeviceMesh | None:
        """All ranks of this rank's pipeline stage: they share the parameter-init seed."""
        if not self.ctx.is_distributed:
            return None
        return self.ctx.mesh_for(MeshDomain.REGULAR)["dp_replicate", "dp_shard", "cp", "tp"]

    def _data_group(self) -> dist.ProcessGroup | None:
        if not self.ctx.is_distributed:
            return None
        batch = self.ctx.mesh_for(MeshDomain.BATCH)
        if self.ctx.params.context_parallel == 1:
            return batch.get_group("dp")
        return batch["dp", "cp"]._flatten().get_group()

    @property
    def _writes_task_metrics(self) -> bool:
        """Task metrics live where losses are computed: the data-rank-0 copy of the last stage writes them."""
        coords = self.ctx.coordinates(MeshDomain.BATCH)
        holds_loss = coords["pp"] == self.runner.loss_pp_rank
        return holds_loss and coords["dp"] == 0 and coords["cp"] == 0 and coords["tp"] == 0

    def _publish_task_metrics(self, wait: bool = False) -> None:
        if self.metric_collector is None:
            return
        for step, value in self.metric_collector.results(wait=wait):
            if self._writes_task_metrics:
                values = to_scalars(value, prefix="task")
                self.reporter.metrics(
                    MetricPoint(step=step, rank=self.ctx.rank, values=values, wall_time=time.time())
                )

    def _resume(self) -> None:
        latest = self.checkpointer.latest()
        if latest is None:
            return
        engine_state, rank_state = self.checkpointer.load(latest, self.modules, self.optimizers)
        self.state.step = int(engine_state["step"])
        self.state.losses = list(engine_state.get("losses", []))
        for scheduler, sd in zip(self.schedulers, engine_state.get("schedulers", []), strict=False):
            scheduler.load_state_dict(sd)
        self.data.load_state_dict(engine_state["data"])
        if rank_state is not None:
            restore_rng_state(rank_state["rng"])
            if self.metric_collector is not None and "metrics" in rank_state:
                self.metric_collector.metric.load_state_dict(rank_state["metrics"])
        self.ctx.logger.info("resumed from %s at step %d", latest, self.state.step)

    # -- loop ---------------------------------------------------------------------------------------

    def train(self) -> RankResult:
        c = self.config
        total = c.trainer.total_steps
        progress = StepProgress(
            total,
            self.state.step,
            self.ctx.logger,
            self.ctx.is_main_process,
            c.logging.progress_bar,
            c.logging.period,
        )
        if c.gc.period is not None:
            gc.disable()
        first_step = True
        tokens_per_s: float | None = None
        status = "finished"
        profiler = self._build_profiler()
        try:
            with profiler:
                while self.state.step < total:
                    if not self._apply_commands():
                        status = "stopped"
                        break
                    step = self.state.step + 1
                    start = time.perf_counter()
                    self.events.publish(StepStarted(step))
                    loss, weight, grad_norm = self._train_step()
                    step_time = time.perf_counter() - start
                    tokens_per_s = weight / step_time if step_time > 0 else None
                    self.state.step = step
                    self.state.losses.append(loss)
                    self.events.publish(StepFinished(step, loss))
                    self._report(step, loss, grad_norm, step_time, tokens_per_s)
                    progress.update(step, loss, self._current_lr(), tokens_per_s)
                    profiler.step()
                    if first_step:
                        self.ctx.set_timeout(timedelta(seconds=c.timeouts.step_s))
                        first_step = False
                    if c.gc.period is not None and step % c.gc.period == 0:
                        gc.collect()
                    period = c.checkpointing.period
                    if self._checkpoint_requested or (period is not None and step % period == 0):
                        self.save_checkpoint()
            if self.state.step > 0 and (status == "stopped" or c.checkpointing.save_at_end):
                self._save_if_new()
            if status == "finished" and c.checkpointing.export_hf_dir is not None:
                self.model_provider.export(self.modules, self.ctx, c.checkpointing.export_hf_dir)
                self.ctx.logger.info("exported the model to %s", c.checkpointing.export_hf_dir)
            if self.metric_collector is not None:
                self._publish_task_metrics(wait=True)  # the last window
                self.metric_collector.close()
        finally:
            progress.close()
            if c.gc.period is not None:
                gc.enable()
        self.events.publish(TrainingFinished(self.state.step, status))
        return RankResult(
            status="finished" if status == "finished" else "stopped",
            steps=self.state.step,
            final_loss=self.state.losses[-1] if self.state.losses else None,
            tokens_per_s=tokens_per_s,
            losses=tuple(self.state.losses),
        )

    def _build_profiler(self) -> StepHook:
        p = self.config.profiling
        if not p.enabled:
            return NullProfiler()
        traces = p.traces_dir if p.traces_dir is not None else self.config.run_dir / "traces"
        return StepProfiler(
            traces, self.ctx.rank, wait=p.wait, warmup=p.warmup, active=p.active, first_step=self.state.step
        )

    def _train_step(self) -> tuple[float, float, float | None]:
        step = self.state.step + 1
        microbatches = self.data.next_step()
        if len(microbatches) != self.grad_accumulation:
            raise RuntimeError(
                f"data provider returned {len(microbatches)} microbatches for step {step}, "
                f"expected gradient_accumulation={self.grad_accumulation} (a finite dataset ran out? "
                "repeat it, e.g. data.options.epochs=null for the text provider, or train for fewer steps)"
            )
        microbatches = [self._to_device(mb) for mb in microbatches]
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self.reducer.begin_step()
        loss_sum, weight = self.runner.forward_backward(microbatches)
        totals = self._global_loss(loss_sum, weight)
        global_loss, global_weight = float(totals[0]), float(totals[1])
        if global_weight <= 0:
            raise RuntimeError(
                f"step {step}: the global loss weight is {global_weight}; no sample had a target"
            )
        self.events.publish(ForwardBackwardFinished(step, global_loss, global_weight))
        self.reducer.finish(totals[1])
        grad_norm = self._clip()
        for optimizer in self.optimizers:
            optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()
        self.events.publish(OptimizerStepFinished(step, grad_norm, self._current_lr()))
        return global_loss / global_weight, global_weight, grad_norm

    def _to_device(self, microbatch: PyTree) -> PyTree:
        if self.ctx.device.type == "cpu":
            return microbatch
        if self.config.data_loading.pin_memory:
            microbatch = tree_map_tensors(lambda t: t.pin_memory(), microbatch)
        return tree_to(microbatch, self.ctx.device, non_blocking=True)

    def _global_loss(self, loss_sum: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Sum of loss and weight over every rank that computes a distinct loss.

        Runners return zeros where no loss is computed (pipeline ranks without the last stage), and
        tensor-parallel ranks compute the same loss, so only tp coordinate 0 contributes.
        """
        totals = torch.stack([loss_sum, weight]).double()
        if not self.ctx.is_distributed:
            return totals
        if self.ctx.coordinates(MeshDomain.REGULAR)["tp"] != 0:
            totals = torch.zeros_like(totals)
        dist.all_reduce(totals)
        return totals

    def _clip(self) -> float | None:
        max_norm = self.config.gradient_clipping.max_norm
        params = [p for m in self.modules for p in m.parameters() if p.requires_grad]
        if max_norm is None or not params:
            return None
        pp_group = None
        if self.ctx.is_distributed and self.ctx.params.pipeline_parallel > 1:
            pp_group = self.ctx.mesh_for(MeshDomain.REGULAR).get_group("pp")
        return float(clip_grad_norm_(params, max_norm, pp_group=pp_group))

    def _current_lr(self) -> float:
        return float(self.optimizers[0].param_groups[0]["lr"]) if self.optimizers else 0.0

    # -- commands, reporting, checkpoints -----------------------------------------------------------

    def _apply_commands(self) -> bool:
        """Apply pending commands at this step boundary; False when training must stop."""
        while True:
            commands = self._broadcast_commands()
            paused = False
            for command in commands:
                if command.kind is CommandKind.STOP:
                    return False
                if command.kind is CommandKind.CHECKPOINT_NOW:
                    self._checkpoint_requested = True
                elif command.kind is CommandKind.UPDATE:
                    self._update(command.values)
                elif command.kind is CommandKind.PAUSE:
                    paused = True
                elif command.kind is CommandKind.RESUME:
                    paused = False
            if self._checkpoint_requested and self.state.step > 0:
                self.save_checkpoint()
            if not paused:
                return True
            self.ctx.logger.info("paused at step %d", self.state.step)
            self._report_paused()
            while True:
                time.sleep(0.2)
                commands = self._broadcast_commands()
                # Apply everything that arrived with a resume/stop before acting on it.
                for command in commands:
                    if command.kind is CommandKind.CHECKPOINT_NOW and self.state.step > 0:
                        self.save_checkpoint()
                    elif command.kind is CommandKind.UPDATE:
                        self._update(command.values)
                if any(cmd.kind in (CommandKind.RESUME, CommandKind.STOP) for cmd in commands):
                    break
            if any(cmd.kind is CommandKind.STOP for cmd in commands):
                return False
            self.ctx.logger.info("resumed at step %d", self.state.step)
            return True

    def _report_paused(self) -> None:
        """`health/rank0/paused` = 1 at the step where the ranks really stopped, which is what a launcher's
        status should say (not when the command was sent). Resuming is not reported: it happens at the
        same step, and a tracker keeps one value per step."""
        if self.ctx.is_main_process:
            self.reporter.metrics(MetricPoint(self.state.step, 0, {"paused": 1.0}, "health", time.time()))

    def _broadcast_commands(self) -> list[Command]:
        commands = list(self.reporter.commands(self.state.step)) if self.ctx.is_main_process else []
        if self.ctx.is_distributed:
            box: list[Any] = [commands]
            dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
            commands = box[0]
        return commands

    def _update(self, values: dict[str, Any]) -> None:
        unknown = set(values) - {"lr"}
        if unknown:
            self.ctx.logger.warning("ignoring settings that cannot change live: %s", sorted(unknown))
        if "lr" in values:
            new_lr = float(values["lr"])
            schedulers: list[torch.optim.lr_scheduler.LRScheduler | None] = (
                list(self.schedulers) if self.schedulers else [None] * len(self.optimizers)
            )
            for optimizer, scheduler in zip(self.optimizers, schedulers, strict=True):
                for i, group in enumerate(optimizer.param_groups):
                    if scheduler is not None:
                        ratio = new_lr / scheduler.base_lrs[i]
                        scheduler.base_lrs[i] = new_lr
                        group["lr"] *= ratio
                    else:
                        group["lr"] = new_lr
            self.ctx.logger.info("learning rate set to %g", new_lr)

    def _report(
        self, step: int, loss: float, grad_norm: float | None, step_time: float, tokens_per_s: float | None
    ) -> None:
        now = time.time()
        self._publish_task_metrics()
        if step % self.config.logging.period != 0 and step != self.config.trainer.total_steps:
            return
        if self.metric_collector is not None:
            self.metric_collector.schedule(step, reset=True)
        if self.ctx.is_main_process:
            values = {"loss": loss, "lr": self._current_lr(), "step_time_s": step_time}
            if grad_norm is not None:
                values["grad_norm"] = grad_norm
            if tokens_per_s is not None:
                values["tokens_per_s"] = tokens_per_s
            values.update(self.step_metrics)
            self.reporter.metrics(MetricPoint(step=step, rank=0, values=values, kind="train", wall_time=now))
        health = {"step_time_s": step_time, "rss_bytes": float(psutil.Process().memory_info().rss)}
        if self.ctx.device.type == "cuda":
            health["cuda_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(self.ctx.device))
        self.reporter.metrics(
            MetricPoint(step=step, rank=self.ctx.rank, values=health, kind="health", wall_time=now)
        )

    def save_checkpoint(self) -> None:
        step = self.state.step
        self._checkpoint_requested = False
        engine_state = {
            "step": step,
            "world_size": self.ctx.world_size,
            "losses": list(self.state.losses),
            "schedulers": [s.state_dict() for s in self.schedulers],
            "data": self.data.state_dict(),
        }
        path = self.checkpointer.save(step, self.modules, self.optimizers, engine_state, self._rank_state())
        self._last_saved = step
        self.events.publish(CheckpointSaved(step, path))

    def _rank_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rng": capture_rng_state()}
        if self.metric_collector is not None:
            state["metrics"] = self.metric_collector.metric.state_dict()
        return state

    def _save_if_new(self) -> None:
        if getattr(self, "_last_saved", None) != self.state.step:
            self.save_checkpoint()

    @property
    def stages(self) -> Sequence[nn.Module]:
        return self.modules
