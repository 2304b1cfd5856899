"""Building this rank's model stages, shared by training and inference.

Every stage goes through the same steps: built on the meta device (nothing allocated), parallelized by the
model provider (parameters become DTensors, still on meta), materialized on the device (`to_empty`),
initialized under the stage's parameter seed (identical on every rank of the stage, so replicas agree),
switched to train or eval mode, set to the job's activation checkpointing (training only,
d9d.modules.checkpointing), and finally compiled (regional `torch.compile`, d9d.parallel.compile).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.determinism import parameter_init_rng, stage_seed
from d9d.engine.errors import ConfigError
from d9d.engine.parallel_checks import check_op_checkpointing_compiled
from d9d.engine.providers import ModelProvider
from d9d.modules.checkpointing import (
    ActivationCheckpointingConfig,
    NoActivationCheckpointing,
    apply_activation_checkpointing,
)
from d9d.parallel.compile import (
    CompileConfig,
    CompileReport,
    check_compile_available,
    compile_enabled,
    compile_stage,
    regions_at_recompile_limit,
)
from d9d.parallel.grad_sync import unsynced_params
from d9d.pipeline.api import PipelineStageInfo


@dataclass(frozen=True)
class Stages:
    """This rank's stages (one without pipelining, several under interleaved and V schedules)."""

    infos: tuple[PipelineStageInfo, ...]
    modules: tuple[nn.Module, ...]
    compile_reports: tuple[CompileReport, ...] = ()

    def __post_init__(self) -> None:
        if not self.modules or len(self.infos) != len(self.modules):
            raise ValueError(f"{len(self.infos)} stage infos for {len(self.modules)} stage modules")

    @property
    def by_index(self) -> dict[int, nn.Module]:
        """Global stage index -> module."""
        return {info.current_stage: m for info, m in zip(self.infos, self.modules, strict=True)}

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]


def stage_mesh(ctx: DistributedContext) -> DeviceMesh | None:
    """All ranks of this rank's pipeline stage: they share the parameter-init seed."""
    if not ctx.is_distributed:
        return None
    return ctx.mesh_for(MeshDomain.REGULAR)["dp_replicate", "dp_shard", "cp", "tp"]


def build_stages(
    provider: ModelProvider,
    infos: list[PipelineStageInfo],
    ctx: DistributedContext,
    *,
    parameter_seed: int,
    compile_config: CompileConfig,
    training: bool,
    split_backward: bool = False,
    activation_checkpointing: ActivationCheckpointingConfig | None = None,
) -> Stages:
    """`split_backward`: the pipeline schedule runs input and weight passes separately (compiled regions
    must then keep their saved activations through the first, see `compile_stage`).
    `activation_checkpointing`: applied to every training stage's decoder stacks, layers chosen by their
    global index (`plan_layers`); a stage without a decoder stack is refused unless the mode is none."""
    checkpointing = activation_checkpointing or NoActivationCheckpointing()
    try:  # before anything is built: a config that cannot compile here fails with its reason
        check_compile_available(compile_config, ctx.device)
        if training and compile_enabled(compile_config, ctx.device):
            check_op_checkpointing_compiled(ctx.params, checkpointing)
    except ValueError as error:
        raise ConfigError(str(error)) from error
    modules = []
    reports: list[CompileReport] = []
    for position, info in enumerate(infos):
        with torch.device("meta"):
            module = provider.build_stage(info)
        provider.parallelize(module, ctx)
        if training:
            check_gradient_sync(module, ctx, info)
        module.to_empty(device=ctx.device)
        seed = stage_seed(parameter_seed, position, info.current_stage)
        with torch.no_grad(), parameter_init_rng(seed, stage_mesh(ctx)):
            provider.initialize(module, ctx)
        module.train(training)
        if training:
            apply_stage_checkpointing(module, checkpointing, info)
        reports.append(compile_stage(module, compile_config, ctx.device, split_backward=split_backward))
        modules.append(module)
    _log_compile(ctx, reports, split_backward=split_backward and training)
    return Stages(tuple(infos), tuple(modules), tuple(reports))


def apply_stage_checkpointing(
    module: nn.Module, config: ActivationCheckpointingConfig, info: PipelineStageInfo
) -> None:
    """The job's checkpointing on one stage's decoder stacks; a stage without one is refused unless the mode
    is none. Before compilation, which reads nothing of it (a block's compiled region applies an op-level
    policy handed to each call, `d9d.parallel.compile`), so the order is only for the reader."""
    stacks = apply_activation_checkpointing(module, config)
    if stacks == 0 and not isinstance(config, NoActivationCheckpointing):
        raise ConfigError(
            f"activation_checkpointing.mode={config.mode}: stage {info.current_stage} of the model "
            f"({type(module).__name__}) has no decoder stack to checkpoint (a module with decoder_layers() "
            "and set_activation_checkpointing(), e.g. d9d.models.decoder.DecoderBackbone); set mode: none"
        )


def check_gradient_sync(module: nn.Module, ctx: DistributedContext, info: PipelineStageInfo) -> None:
    """With data parallelism, every trainable parameter must be covered by a gradient sync (replicate,
    FSDP/HSDP, expert parallelism record it on the module); one that is not would train on this replica's
    data alone and the replicas would silently drift apart. An error rather than a replicate applied here:
    the provider alone knows the layout it meant (it may have forgotten FSDP, not replication)."""
    dp = ctx.params.data_parallel
    if dp == 1:
        return
    missing = unsynced_params(module)
    if missing:
        listing = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ConfigError(
            f"model: with data parallelism {dp} (mesh.data_parallel_replicate × data_parallel_shard), "
            f"{len(missing)} trainable parameter(s) of stage {info.current_stage} have no gradient sync: "
            f"{listing}. The model provider's parallelize() must apply replicate_plain, "
            "parallelize_replicate, parallelize_fsdp or parallelize_hsdp (d9d.parallel) to them, or "
            "freeze them"
        )


def _log_compile(ctx: DistributedContext, reports: list[CompileReport], *, split_backward: bool) -> None:
    """One line per run (stages of a rank compile alike; a differing report is logged too), and a warning
    where a schedule splitting backward meets compiled regions whose weight gradients are not deferred
    (without `compile.defer_weight_grads`)."""
    if not ctx.is_main_process:
        return
    lines = dict.fromkeys((r.enabled, r.regions, r.reason) for r in reports)
    for enabled, regions, reason in lines:
        ctx.logger.info(
            "compile: %s, regions %s (%s)", "on" if enabled else "off", ", ".join(regions) or "none", reason
        )
    if split_backward and any(r.enabled and r.modules > 0 and not r.deferred_weight_grads for r in reports):
        # Correct, but not what a user choosing a zero-bubble schedule expects: say so once, at build time.
        # With compile.defer_weight_grads the blocks' projections run eagerly and the weight passes get them.
        ctx.logger.warning(
            "pipelining: this schedule splits backward into input and weight passes, but a compiled "
            "block's backward computes its weight gradients in the input pass; only what lies outside the "
            "compiled regions (embedding, final norm, head) is deferred, so the weight passes fill little "
            "of the bubble. Measured on 2 × H200, compiled dense pp 2 (docs/benchmarks.md): ZBV at 0.95x of "
            "1F1B; compile.defer_weight_grads: true (projections outside the compiled graphs, their weight "
            "gradients deferred) at 0.44x of ZBV without it. Prefer pipelining.kind 1f1b or "
            "interleaved_1f1b with compile (and compile.mode: reduce-overhead where nothing but the "
            "pipeline shards the stages: CUDA graphs, 1.19-1.46x of 1F1B's default mode there), or "
            "compile.enabled: false with a zero-bubble schedule (docs/pipelining.md)"
        )


def log_compile_warmup(ctx: DistributedContext, stages: Stages) -> None:
    """After the first step (when the compiled regions have been traced and compiled): how long it took,
    and a warning if a region reached dynamo's recompile limit (its later layers then run eagerly)."""
    if not ctx.is_main_process:
        return
    enabled = [report for report in stages.compile_reports if report.enabled]
    for report in enabled:
        stats = report.stats
        ctx.logger.info(
            "compile warm-up: %.1f s, %d graph(s)%s",
            stats.compile_seconds,
            stats.graphs,
            f"; fell back to eager: {stats.failure}" if stats.failure else "",
        )
    at_limit = regions_at_recompile_limit() if enabled else []
    if at_limit:
        ctx.logger.warning(
            "compile: %s reached torch._dynamo's recompile_limit (%d compiled variants): the layers after it "
            "run eagerly, which is slow. Layers should share one graph; something differs between them "
            "(run with TORCH_LOGS=recompiles to see what) — please report it",
            ", ".join(at_limit),
            int(torch._dynamo.config.recompile_limit),
        )
