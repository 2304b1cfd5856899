"""What a job would be, without running it: the rank layout, the parameter count and a memory estimate.

Nothing here creates a process group, a device tensor or an actor. Coordinates come from the same layout
arithmetic the ranks use (`d9d.core.domains`); parameters are counted on model stages built on the meta
device by the job's own model provider (so PEFT injection and freezing are included); memory per rank is an
estimate from those meta parameters, their dtypes and the mesh:

- parameters: expert weights (`GroupedExperts`) split over `expert_parallel`; for a model family's causal LM
  (a built-in provider, or a plug-in with the `ModelArchitecture` trait) the parameters its plan splits over
  `tensor_parallel` (`ModelFamily.footprint`); everything but experts split over FSDP's
  `data_parallel_shard × context_parallel_shard` (the experts too when `expert_parallel` and
  `tensor_parallel` are both 1: the decoder plan then leaves them to FSDP). Other models: FSDP sharding
  only. Where FSDP keeps every unit gathered from forward to backward — pipeline steps always, otherwise
  `fsdp.reshard_after_forward` `never`, or `auto` under `keep_gathered_gib` — the rank holds the gathered
  parameters too at the end of forward. Where the units reshard, a built-in causal LM's rank holds the units
  that stay gathered (the root; under `auto` the last unit too) and `1 + max(forward_prefetch,
  backward_prefetch)` of its largest resharding unit (`fsdp.layers_per_unit` layers each) gathered at once;
  other models: not counted.
- gradients: trainable parameters, sharded alike, in `gradient_manager.grad_dtype` (default: theirs); where
  FSDP reduces once per step (pipeline steps always; otherwise `fsdp.reduce_every`, `auto` under
  `keep_gathered_gib`, with several microbatches) the FSDP parameters' gradients are held unsharded too, in
  FSDP's reduce dtype (default: theirs).
- optimizer state: AdamW two moments in the parameter dtype, stochastic AdamW two in its `state_dtype`,
  SGD one momentum buffer when `momentum > 0`; a plug-in optimizer is not estimated.
- activations, for a model family's causal LM with a known sequence length only: the values per token its
  layers keep for backward (the family's footprint; for the catalogue's decoders about `8 × hidden +
  3 × ffn` per layer: norm, attention and MLP inputs and outputs, `ffn` being `intermediate_size`, or
  `num_experts_per_tok × moe_intermediate_size` in MoE layers) in the parameter dtype, split over
  `tensor_parallel × context_parallel`, times the microbatches a pipeline rank holds at once (1 without
  pipelining, `pp − pp_rank` under 1F1B-style schedules, all under GPipe), plus one loss chunk of fp32 logits
  (`loss_chunk_size × vocab`). Attention scores are not stored (SDPA). Under `activation_checkpointing`, a
  checkpointed layer keeps only its input (`hidden` values per token; op-level selective: also its matmul and
  attention outputs, the family's `layer_op_values`; `every: k` with `ops`: every k-th layer the input only,
  the others also their op outputs), and the rank holds one layer's full activations again (one microbatch)
  while backward recomputes it.
  Temporary buffers, allocator fragmentation and communication buffers come on top.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import assert_never

import torch
from torch import nn

from d9d.core.domains import MeshDomain, compute_layout
from d9d.core.mesh_params import DeviceMeshParameters
from d9d.engine.builtin.models import CausalLMProvider
from d9d.engine.builtin.peft import PeftModelProvider
from d9d.engine.components import SGD, AdamW, StochasticAdamW, TextData
from d9d.engine.config import TrainConfig
from d9d.engine.providers import ModelArchitecture, ModelProvider
from d9d.engine.registry import build_model
from d9d.models.decoder.plan import fsdp_units
from d9d.models.decoder.tasks import DecoderStageModel
from d9d.models.family import StageFootprint
from d9d.modules.checkpointing import (
    FullActivationCheckpointing,
    NoActivationCheckpointing,
    SelectiveActivationCheckpointing,
    plan_layers,
)
from d9d.modules.moe import GroupedExperts
from d9d.parallel.fsdp import GIB, FSDPConfig, reshard_units
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.schedule.config import GPipeSchedule

LAYOUT_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


@dataclass(frozen=True)
class RankCoordinates:
    rank: int
    coordinates: dict[str, int]  # LAYOUT_DIMS -> index

    def line(self) -> str:
        return f"rank {self.rank}: " + " ".join(f"{d}={self.coordinates[d]}" for d in LAYOUT_DIMS)


def rank_layout(mesh: DeviceMeshParameters) -> list[RankCoordinates]:
    """Every rank's coordinate along each parallel dimension (ep: its shard of the experts)."""
    regular = compute_layout(mesh, MeshDomain.REGULAR)
    expert = compute_layout(mesh, MeshDomain.EXPERT)
    out = []
    for rank in range(mesh.world_size):
        coords = regular.coordinates(rank)
        coords["ep"] = expert.coordinates(rank)["ep_shard"]
        out.append(RankCoordinates(rank, coords))
    return out


@dataclass(frozen=True)
class ParameterCount:
    total: int
    trainable: int
    bytes: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank; None where it cannot be estimated (the reason is in `notes`)."""

    ranks: tuple[int, ...]
    pp_rank: int
    parameters: int
    gradients: int
    optimizer: int | None
    activations: int | None
    notes: tuple[str, ...]

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + (self.optimizer or 0) + (self.activations or 0)


@dataclass(frozen=True)
class DryRunReport:
    mesh: DeviceMeshParameters
    gradient_accumulation: int
    layout: list[RankCoordinates]
    parameters: ParameterCount
    memory: list[MemoryEstimate]  # one per pipeline rank (all ranks of a stage hold the same amount)


def _unique_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    yield from module.named_parameters()  # shared (tied) parameters once


def count_parameters(provider: ModelProvider) -> ParameterCount:
    """The whole model (one stage holding every layer), built on meta by the provider itself."""
    with torch.device("meta"):
        module = provider.build_stage(PipelineStageInfo())
    total = trainable = size = 0
    for _, p in _unique_parameters(module):
        total += p.numel()
        size += p.numel() * p.element_size()
        trainable += p.numel() if p.requires_grad else 0
    return ParameterCount(total, trainable, size)


def _architecture(provider: ModelProvider) -> ModelArchitecture | None:
    """The model family and config of the provider (under PEFT: of its base), None for other plug-ins."""
    base = provider.base if isinstance(provider, PeftModelProvider) else provider
    return base if isinstance(base, ModelArchitecture) else None


def _footprint(architecture: ModelArchitecture | None, module: nn.Module) -> StageFootprint | None:
    if architecture is None:
        return None
    return architecture.family.footprint(architecture.model_config, module)


def _base(provider: ModelProvider) -> ModelProvider:
    return provider.base if isinstance(provider, PeftModelProvider) else provider


def _fsdp_config(provider: ModelProvider) -> FSDPConfig:
    """The built-in providers' FSDP settings (`model.options.parallel.fsdp`); the defaults for plug-ins."""
    base = _base(provider)
    return base.options.parallel.fsdp if isinstance(base, CausalLMProvider) else FSDPConfig()


def _expert_parameters(module: nn.Module) -> set[nn.Parameter]:
    return {p for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}


def _stage_infos(config: TrainConfig, mesh: DeviceMeshParameters, pp_rank: int) -> list[PipelineStageInfo]:
    pp = mesh.pipeline_parallel
    if pp == 1:
        return [PipelineStageInfo()]
    placement = config.schedule.placement(pp)
    n = len(placement.stage_ranks)
    return [PipelineStageInfo(s, n) for s, r in enumerate(placement.stage_ranks) if r == pp_rank]


def _grad_dtype(config: TrainConfig, param: nn.Parameter) -> torch.dtype:
    return config.gradient_manager.resolve_grad_dtype(param.dtype)


def _optimizer_bytes(config: TrainConfig, trainable: list[tuple[nn.Parameter, int]]) -> int | None:
    """Optimizer state of the given (parameter, local element count) pairs."""
    match config.optimizer:
        case AdamW():
            return sum(2 * n * p.element_size() for p, n in trainable)
        case StochasticAdamW():
            size = torch.empty((), dtype=getattr(torch, config.optimizer.options.state_dtype)).element_size()
            return sum(2 * n * size for _, n in trainable)
        case SGD():
            buffers = 1 if config.optimizer.options.momentum > 0 else 0
            return sum(buffers * n * p.element_size() for p, n in trainable)
        case _:
            return None


def _sequence_length(config: TrainConfig) -> int | None:
    match config.data:
        case TextData():
            return config.data.options.dataset.max_length
        case _:
            return None


def _in_flight(config: TrainConfig, mesh: DeviceMeshParameters, pp_rank: int, accumulation: int) -> int:
    pp = mesh.pipeline_parallel
    if pp == 1:
        return 1
    if isinstance(config.schedule, GPipeSchedule):
        return accumulation
    return min(pp - pp_rank, accumulation)


@dataclass(frozen=True)
class _StageValues:
    """Values per token one microbatch keeps on a stage under the job's activation checkpointing, and the
    extra values the largest checkpointed layer holds again while its backward recomputes it."""

    kept: int
    recompute_peak: int
    checkpointed: int  # layers
    op_level: int  # of which under an op-level policy (the rest whole-layer)
    modelled: bool  # False: op-level values not modelled for this family (counted as not checkpointed)


def _stage_values(config: TrainConfig, footprint: StageFootprint) -> _StageValues:
    plan = plan_layers(config.activation_checkpointing, footprint.layer_values)
    kept = peak = 0
    modelled = True
    for index, values in footprint.layer_values.items():
        if index not in plan:
            kept += values
            continue
        policy = plan[index]
        keeps = footprint.layer_input_values
        if policy is not None:
            if footprint.layer_op_values is None:
                modelled = False
                keeps = values
            else:
                keeps += footprint.layer_op_values[index]
        keeps = min(keeps, values)
        kept += keeps
        peak = max(peak, values - keeps)
    op_level = sum(policy is not None for policy in plan.values())
    return _StageValues(kept, peak, len(plan), op_level, modelled)


def _checkpointing_note(config: TrainConfig, stages: list[_StageValues]) -> str:
    ac = config.activation_checkpointing
    layers = sum(s.checkpointed for s in stages)
    op_level = sum(s.op_level for s in stages)
    match ac:
        case NoActivationCheckpointing():
            return ""
        case FullActivationCheckpointing():
            what, keeps = "full", f"each of the {layers} checkpointed layer(s) here keeps its input (hidden)"
        case SelectiveActivationCheckpointing(every=int() as every, ops=tuple() as ops):
            # two kinds of checkpointed layer, each with its own count and what it keeps
            what = f"selective every {every} + ops {list(ops)}"
            keeps = (
                f"of the {layers} checkpointed layer(s) here, the {layers - op_level} whole-layer one(s) "
                f"keep their input (hidden), the {op_level} op-level one(s) their input and matmul/attention "
                "outputs"
            )
        case SelectiveActivationCheckpointing(every=int() as every):
            what = f"selective every {every}"
            keeps = f"each of the {layers} checkpointed layer(s) here keeps its input (hidden)"
        case SelectiveActivationCheckpointing():
            what = f"selective ops {list(ac.ops or ())}"
            keeps = (
                f"each of the {layers} checkpointed layer(s) here keeps its input and its matmul/attention "
                "outputs"
            )
        case _:
            assert_never(ac)
    if not all(s.modelled for s in stages):
        return (
            f"; activation_checkpointing {what}: op-level values not modelled for this family (op-level "
            "layers counted as not checkpointed)"
        )
    return (
        f"; activation_checkpointing {what}: {keeps}, plus one layer's recompute (its full activations, one "
        "microbatch)"
    )


def _activation_bytes(
    config: TrainConfig,
    mesh: DeviceMeshParameters,
    modules: list[nn.Module],
    footprints: list[StageFootprint | None],
    in_flight: int,
) -> tuple[int | None, str]:
    seq = _sequence_length(config)
    if not footprints or any(f is None for f in footprints):
        return None, "activations: not estimated (a model outside the catalogue)"
    if seq is None:
        return None, "activations: not estimated (no sequence length: data.options.dataset.max_length)"
    tokens = config.batching.microbatch_size * seq
    dtype_bytes = next(p for m in modules for p in m.parameters()).element_size()
    stages: list[_StageValues] = []
    logits = 0
    for footprint in footprints:
        assert footprint is not None
        stages.append(_stage_values(config, footprint))
        if footprint.loss_chunk is not None:
            chunk, vocab = footprint.loss_chunk
            logits = min(chunk, tokens) * vocab * 4
    values = sum(s.kept for s in stages)
    # one recomputation at a time per rank: the largest over its stages, for one microbatch
    peak = max(s.recompute_peak for s in stages)
    split = mesh.tensor_parallel * mesh.context_parallel
    per_microbatch = tokens * values * dtype_bytes // split
    recompute = tokens * peak * dtype_bytes // split
    checkpointing = _checkpointing_note(config, stages)
    note = (
        f"activations: {in_flight} microbatch(es) in flight × {tokens} tokens × Σ(8·hidden + 3·ffn) per "
        f"layer × {dtype_bytes} B / (tp·cp = {split})"
        + (" + one layer's recompute" if recompute else "")
        + (" + one fp32 loss chunk" if logits else "")
        + checkpointing
    )
    return in_flight * per_microbatch + recompute + logits // mesh.tensor_parallel, note


def _local(numel: int, parts: int) -> int:
    return math.ceil(numel / parts)


def estimate_memory(
    config: TrainConfig, mesh: DeviceMeshParameters, provider: ModelProvider, pp_rank: int, accumulation: int
) -> MemoryEstimate:
    with torch.device("meta"):
        modules = [provider.build_stage(info) for info in _stage_infos(config, mesh, pp_rank)]
    architecture = _architecture(provider)
    footprints = [_footprint(architecture, module) for module in modules]
    fsdp = mesh.data_parallel_shard * mesh.context_parallel_shard
    params = grads = gathered = sharded = 0  # the last two: FSDP's parameters gathered, and their shards
    unsharded: dict[nn.Parameter, int] = {}  # per FSDP-sharded parameter: its gathered bytes less its shard
    fsdp_config = _fsdp_config(provider)
    # Where FSDP reduces once per step it holds each trainable FSDP parameter's gradient unsharded through
    # the step, in its reduce dtype (else the parameter's): those bytes beyond the shard's; and whether
    # grad_dtype is wider than that accumulation (`reduce_every: auto` then reduces every microbatch).
    unsharded_grads = 0
    grad_dtype_wider = False
    trainable: list[tuple[nn.Parameter, int]] = []
    notes: list[str] = []
    for module, footprint in zip(modules, footprints, strict=True):
        experts = set() if mesh.experts_are_dense_weights else _expert_parameters(module)
        tensor_parallel = footprint.tensor_parallel if footprint is not None else frozenset()
        for _, p in _unique_parameters(module):
            if p in experts:
                n = _local(p.numel(), mesh.expert_parallel)
            else:
                whole = _local(p.numel(), mesh.tensor_parallel if p in tensor_parallel else 1)
                n = _local(whole, fsdp)
                gathered += whole * p.element_size()
                sharded += n * p.element_size()
                unsharded[p] = (whole - n) * p.element_size()
            params += n * p.element_size()
            if p.requires_grad:
                grads += n * _grad_dtype(config, p).itemsize
                trainable.append((p, n))
                if p not in experts:
                    accumulated = fsdp_config.resolve_reduce_dtype()
                    unsharded_grads += (whole - n) * (accumulated or p.dtype).itemsize
                    grad_dtype_wider |= config.gradient_manager.accumulates_wider(p.dtype, accumulated)
    decoder = fsdp > 1 and isinstance(_base(provider), CausalLMProvider)  # the decoder plan makes the units
    per_unit = fsdp_config.resolve_layers_per_unit(gathered)
    once_per_step = fsdp > 1 and (
        mesh.pipeline_parallel > 1
        or (
            accumulation > 1
            and fsdp_config.reduces_once_per_step(gathered, grad_dtype_wider=grad_dtype_wider)
        )
    )
    if fsdp > 1 and (once_per_step or fsdp_config.keeps_units_gathered(gathered)):
        params += gathered - sharded
        notes.append(
            f"parameters: FSDP's units stay gathered from forward to backward ({gathered / GIB:.2f} GiB "
            "gathered, included)"
        )
    elif decoder and len(modules) == 1 and isinstance(modules[0], DecoderStageModel):
        held, note = _gathered_while_resharding(modules[0], fsdp_config, per_unit, unsharded, gathered)
        params += held
        notes.append(note)
    if once_per_step:
        grads += unsharded_grads
        notes.append(
            "gradients: FSDP reduces once per step (pipeline steps, fsdp.reduce_every), holding them "
            f"unsharded until then ({unsharded_grads / GIB:.2f} GiB more, included)"
        )
    if decoder:
        setting = fsdp_config.layers_per_unit
        notes.append(f"FSDP units: {per_unit} decoder layer(s) per unit (fsdp.layers_per_unit {setting})")
    stage_layers = [
        f"stage {m.stage.current_stage}: layers {min(layers)}-{max(layers)}"
        for m in modules
        if isinstance(m, DecoderStageModel) and m.stage.num_stages > 1
        for layers in [list(m.model.decoder_layers())]
        if layers
    ]
    if stage_layers:
        notes.append("pipeline: " + "; ".join(stage_layers) + " (model.options.parallel.stage_split)")
    if footprints[0] is None and mesh.tensor_parallel > 1:
        notes.append("parameters: tensor-parallel sharding of a model outside the catalogue is not modelled")
    optimizer = _optimizer_bytes(config, trainable)
    if optimizer is None:
        notes.append(f"optimizer: not estimated (plug-in {config.optimizer.provider})")
    in_flight = _in_flight(config, mesh, pp_rank, accumulation)
    activations, note = _activation_bytes(config, mesh, modules, footprints, in_flight)
    notes.append(note)
    ranks = tuple(r.rank for r in rank_layout(mesh) if r.coordinates["pp"] == pp_rank)
    return MemoryEstimate(ranks, pp_rank, params, grads, optimizer, activations, tuple(notes))


def _gathered_while_resharding(
    model: DecoderStageModel,
    config: FSDPConfig,
    per_unit: int,
    unsharded: dict[nn.Parameter, int],
    gathered: int,
) -> tuple[int, str]:
    """What a rank holds gathered beyond its shards when FSDP's units reshard after forward (bytes, note):
    the units that stay gathered (the root; under `auto` also the last unit) plus `1 + prefetch` of the
    largest resharding unit: the one computing and the ones its all-gathers run ahead for (in backward, by
    default, one: FSDP2's implicit prefetch)."""
    units = fsdp_units(model, list(model.model.decoder_layers().values()), per_unit)
    unit_reshard, root_reshard = reshard_units(config, len(units), gathered)
    sizes = [
        sum(unsharded.get(p, 0) for m in (u if isinstance(u, list) else [u]) for p in m.parameters())
        for u in units
    ]
    root = sum(unsharded.values()) - sum(sizes)
    kept = (0 if root_reshard else root) + sum(b for b, r in zip(sizes, unit_reshard, strict=True) if not r)
    at_once = 1 + max(config.forward_prefetch, config.backward_prefetch)
    moving = at_once * max((b for b, r in zip(sizes, unit_reshard, strict=True) if r), default=0)
    note = (
        f"parameters: FSDP's units reshard after forward; up to {at_once} of them gathered at a time "
        f"({_size(moving)} beyond their shards) and the units kept gathered ({_size(kept)}), included"
    )
    return kept + moving, note


def dry_run(config: TrainConfig, mesh: DeviceMeshParameters | None = None) -> DryRunReport:
    """Everything `d9d train --dry-run` prints about a validated config, for `mesh` (default: the config's;
    the cluster layer passes the layout for its number of workers)."""
    mesh = mesh or config.mesh
    accumulation = config.batching.gradient_accumulation(mesh.data_parallel)
    provider = build_model(config.model)
    memory = [
        estimate_memory(config, mesh, provider, pp_rank, accumulation)
        for pp_rank in range(mesh.pipeline_parallel)
    ]
    return DryRunReport(mesh, accumulation, rank_layout(mesh), count_parameters(provider), memory)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))


def format_report(report: DryRunReport) -> str:
    m = report.mesh
    lines = [
        f"mesh: {m.world_size} rank(s) = pp {m.pipeline_parallel} × dp_replicate "
        f"{m.data_parallel_replicate} × dp_shard {m.data_parallel_shard} × cp {m.context_parallel} × tp "
        f"{m.tensor_parallel}; experts over ep {m.expert_parallel}; {report.gradient_accumulation} "
        "microbatch(es) per rank and step",
        *(r.line() for r in report.layout),
    ]
    p = report.parameters
    share = 100.0 * p.trainable / p.total if p.total else 0.0
    lines.append(
        f"parameters: {p.total:,} total ({_size(p.bytes)}), {p.trainable:,} trainable ({share:.2f}%)"
    )
    lines.append("memory per rank (estimate):")
    for e in report.memory:
        optimizer = _size(e.optimizer) if e.optimizer is not None else "?"
        activations = _size(e.activations) if e.activations is not None else "?"
        lines.append(
            f"  {_ranks(e.ranks)} (pp={e.pp_rank}): parameters {_size(e.parameters)} + gradients "
            f"{_size(e.gradients)} + optimizer {optimizer} + activations {activations} = {_size(e.total)}"
            + ("" if e.optimizer is not None and e.activations is not None else " + what is not estimated")
        )
        lines.extend(f"    {note}" for note in e.notes)
    return "\n".join(lines)
