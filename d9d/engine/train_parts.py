"""Everything a training rank is made of, built from the config in one fixed order.

The order matters for reproducibility (RNG draws) and for collectives (every rank creates the pipeline's
process groups at the same point): seeds → task → data → model stages (`d9d.engine.stages`) → activation
seed → event subscriptions → optimizers → LR schedulers → task metrics → step runner → gradient reducer →
checkpointer → evaluator. The training data is read through a `PrefetchingLoader` (on the step thread
unless `data_loading.num_workers` is 1). The loop (`d9d.engine.trainer`) only uses the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.data.prefetch import PrefetchingLoader
from d9d.determinism import RankSeeds, seed_everything, stage_seed
from d9d.engine.checkpoint import Checkpointer
from d9d.engine.components import build_data, build_lr_scheduler, build_optimizer, build_task
from d9d.engine.config import TrainConfig
from d9d.engine.evaluation import Evaluator
from d9d.engine.events import EventBus
from d9d.engine.exchange import ExchangeCapacityGuard
from d9d.engine.identity import run_identity
from d9d.engine.providers import DataProvider, DataSetup, ModelProvider, OptimizerProvider, TrainTask
from d9d.engine.registry import build_model, check_optimizer_fits
from d9d.engine.reporting import StepReporter, build_flops_budget
from d9d.engine.runtime import RunReporter
from d9d.engine.stages import Stages, build_stages
from d9d.engine.state import EngineState, TrainProgress
from d9d.engine.step import (
    ContextShardedStepRunner,
    GradientClipper,
    GradientReducer,
    PipelinedStepRunner,
    SequentialStepRunner,
    StepRunner,
    build_gradient_reducer,
    data_group,
    once_per_step_sharding,
)
from d9d.engine.step_metrics import StepMetrics
from d9d.metrics import AsyncMetricCollector, ComposeMetric
from d9d.optim.param_groups import parameter_name
from d9d.parallel.context import ContextParallelGroup
from d9d.parallel.expert import exchange_capacities
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.optim import PipelinedLRScheduler, PipelinedOptimizer
from d9d.pipeline.setup import PipelineSetup


@dataclass(frozen=True)
class TrainParts:
    seeds: RankSeeds
    grad_accumulation: int
    task: TrainTask
    data: PrefetchingLoader
    model: ModelProvider
    stages: Stages
    optimizer: PipelinedOptimizer
    schedulers: PipelinedLRScheduler | None
    reducer: GradientReducer
    clipper: GradientClipper
    runner: StepRunner
    reports: StepReporter
    checkpointer: Checkpointer
    state: EngineState
    evaluator: Evaluator | None
    exchange: ExchangeCapacityGuard


def build_train_parts(
    config: TrainConfig,
    ctx: DistributedContext,
    reporter: RunReporter,
    events: EventBus,
    progress: TrainProgress,
) -> TrainParts:
    c = config
    seeds = RankSeeds.for_rank(ctx.params, ctx.rank, c.determinism.seed)
    task = build_task(c.task)
    grad_accumulation = c.batching.gradient_accumulation(ctx.params.data_parallel)
    provider: DataProvider = build_data(c.data)
    provider.setup(
        DataSetup(
            dp_rank=ctx.coordinates(MeshDomain.BATCH)["dp"],
            dp_size=ctx.params.data_parallel,
            microbatch_size=c.batching.microbatch_size,
            gradient_accumulation=grad_accumulation,
            global_batch_size=c.batching.global_batch_size,
            seed=c.determinism.seed,
        )
    )
    data = PrefetchingLoader(provider, c.data_loading.prefetch_depth)
    model = build_model(c.model)
    optimizer_provider = build_optimizer(c.optimizer)
    check_optimizer_fits(c, optimizer_provider, model)
    pipeline: PipelineSetup | None = None
    infos = [PipelineStageInfo()]
    if ctx.params.pipeline_parallel > 1:
        pipeline = PipelineSetup.create(ctx, c.schedule, grad_accumulation)
        infos = pipeline.local_stages
    stages = build_stages(
        model,
        infos,
        ctx,
        parameter_seed=seeds.parameters,
        compile_config=c.compile,
        training=True,
        split_backward=pipeline is not None and pipeline.program.splits_backward,
        activation_checkpointing=c.activation_checkpointing,
    )
    seed_everything(seeds.activations)
    step_metrics = StepMetrics()
    model.subscribe(events, stages.modules, ctx, step_metrics)
    optimizer = PipelinedOptimizer(
        {
            s: _stage_optimizer(optimizer_provider, m, stage_seed(seeds.parameters, position, s), ctx.device)
            for position, (s, m) in enumerate(stages.by_index.items())
        }
    )
    schedulers = None
    if c.lr_scheduler is not None:
        scheduler_provider = build_lr_scheduler(c.lr_scheduler)
        schedulers = PipelinedLRScheduler.build(
            optimizer, lambda o: scheduler_provider.build(o, c.trainer.total_steps)
        )
    metrics = task.create_metrics()
    runner: StepRunner
    once_per_step: list[torch.Tensor] = []
    if pipeline is not None:
        executor = pipeline.executor(stages.by_index)
        once_per_step = executor.reduced_once_per_step()
        runner = PipelinedStepRunner(executor, task, ctx.device, metrics)
    else:
        module = stages.modules[0]
        sharding = once_per_step_sharding(module, grad_accumulation, c.gradient_manager)
        if sharding is not None:
            once_per_step = sharding.reduced_params()
        runner = SequentialStepRunner(module, task, ctx.device, metrics, sharding)
    reducer = build_gradient_reducer(
        optimizer.pair_with(stages.by_index), c.gradient_manager, grad_accumulation, once_per_step
    )
    collector: AsyncMetricCollector[Any] | None = None
    if metrics:
        # Synced over the ranks that see different data; computed on a side thread so steps don't wait.
        collector = AsyncMetricCollector(ComposeMetric(metrics), group=data_group(ctx))
    if ctx.params.context_parallel > 1:
        runner = ContextShardedStepRunner(runner, ContextParallelGroup.from_context(ctx))
    exchange = ExchangeCapacityGuard(ctx, [c for m in stages.modules for c in exchange_capacities(m)])
    return TrainParts(
        seeds=seeds,
        grad_accumulation=grad_accumulation,
        task=task,
        data=data,
        model=model,
        stages=stages,
        optimizer=optimizer,
        schedulers=schedulers,
        reducer=reducer,
        clipper=GradientClipper(ctx, stages.trainable_parameters(), c.gradient_clipping.max_norm),
        runner=runner,
        reports=StepReporter(
            ctx,
            reporter,
            period=c.logging.period,
            total_steps=c.trainer.total_steps,
            collector=collector,
            loss_pp_rank=runner.loss_pp_rank,
            step_metrics=step_metrics,
            flops=build_flops_budget(model, ctx, c.batching.global_batch_size),
        ),
        checkpointer=Checkpointer(
            ctx,
            c.checkpoint_dir,
            reporter,
            trainable_only=c.checkpointing.trainable_only,
            identity=run_identity(c),
            train_config=c.model_dump(mode="json"),
        ),
        state=EngineState(
            progress,
            ctx.world_size,
            schedulers,
            data,
            collector.metric if collector is not None else None,
            exchange if exchange.enabled else None,
        ),
        evaluator=None
        if c.eval is None
        else Evaluator(
            c.eval,
            ctx,
            reporter,
            task,
            stages,
            seed=c.determinism.seed,
            pin_memory=c.data_loading.pin_memory,
        ),
        exchange=exchange,
    )


def _stage_optimizer(
    provider: OptimizerProvider, module: nn.Module, seed: int, device: torch.device
) -> torch.optim.Optimizer:
    """The stage's optimizer over its trainable parameters, handed to the provider with their state-dict
    names (`parameter_name`: wrapper segments removed). A pipeline stage may have none (PEFT: the
    targeted modules are all on other stages, e.g. `model\\.norm` on the last): it still gets the
    provider's optimizer, with empty parameter groups, so that every stage has the same optimizer type,
    hyperparameters and LR schedule (it adds no optimizer state to checkpoints, `d9d.engine.checkpoint`).
    torch refuses an empty parameter list, so that one is built over a zero-size placeholder (on the
    stage's device: it picks fused kernels there), then removed."""
    named = [(parameter_name(name), p) for name, p in module.named_parameters()]
    if any(p.requires_grad for _, p in named):
        return provider.build(named, seed=seed)
    placeholder = nn.Parameter(torch.empty(0, device=device))
    optimizer = provider.build([("<placeholder>", placeholder)], seed=seed)
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p is not placeholder]
    optimizer.state.pop(placeholder, None)
    return optimizer
