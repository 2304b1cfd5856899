"""Built-in model providers: one causal-LM provider per registered model family (`d9d.models.families()`),
and the `model` section's members that select them.

Weights come from a random init or a Hugging Face checkpoint (`source_checkpoint`), streamed through the
family's HF→d9d state mapper directly into the (possibly sharded) stage; `export` writes Hugging Face format
back. Everything architecture-specific comes from the family spec; nothing here names a family.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar, Union, cast

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    model_validator,
)
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.dist_ops import all_gather_object
from d9d.core.domains import MeshDomain
from d9d.core.host_copy import HostCopy
from d9d.engine.errors import prefixed
from d9d.engine.events import EventBus, OptimizerStepFinished, StepRepeated, StepSkipped
from d9d.engine.plugins import PLUGIN_TAG, BuiltinComponent, PluginSpec, provider_tag, tag
from d9d.engine.providers import ModelProvider
from d9d.engine.step_metrics import StepMetrics
from d9d.models.family import ModelFamily, families, family_of
from d9d.models.hf.config import config_from_hf, config_to_hf
from d9d.models.hf.io import side_files
from d9d.models.hf.mapping import d9d_to_hf_mapper, hf_to_d9d_mapper_for
from d9d.modules.base import ModuleLateInit
from d9d.modules.moe import MoELayer, MoEMetrics, TopKRouter, take_aux_loss_stats
from d9d.modules.moe.stats import AuxLossStats
from d9d.parallel.plans import ParallelPlanConfig
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.split import build_stage_split
from d9d.state import load_model_state, read_header, resolve_checkpoint, save_model_state


class CausalLMOptions(BaseModel):
    """`model.options` of a built-in family's provider (`family` is the family it selects)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    family: ClassVar[ModelFamily[Any]]

    # Architecture (d9d config fields), or None to take it from `source_checkpoint`'s config.json.
    architecture: dict[str, Any] | None = None
    # A Hugging Face directory to initialize from; `architecture` then overrides d9d-only fields.
    source_checkpoint: Path | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    # How data/tensor/expert parallelism is applied (the mesh sizes come from the job's `mesh`).
    parallel: ParallelPlanConfig = Field(default_factory=ParallelPlanConfig)

    @model_validator(mode="after")
    def _need_one(self) -> CausalLMOptions:
        if self.architecture is None and self.source_checkpoint is None:
            raise ValueError(
                "give `architecture` (random init) or `source_checkpoint` (a Hugging Face directory)"
            )
        if self.source_checkpoint is not None and not (self.source_checkpoint / "config.json").is_file():
            raise ValueError(f"source_checkpoint {self.source_checkpoint} has no config.json")
        if self.source_checkpoint is None:
            try:  # fail at config time, with field names under `architecture`
                self.family.config_class.model_validate(self.architecture)
            except ValidationError as e:
                raise prefixed(e, "architecture") from None
        return self


class CausalLMProvider:
    """The causal LM of a model family; `model_config` is its architecture, `family` the family that builds,
    parallelizes, loads and exports it (the `ModelArchitecture` trait)."""

    Config: ClassVar[type[CausalLMOptions]] = CausalLMOptions

    def __init__(self, config: CausalLMOptions) -> None:
        self.options = config
        self.model_config: Any = self._resolve_config()
        # A checkpoint of a more specific family than the provider's (a Qwen3-MoE one under `qwen3`) builds
        # its own family's model.
        self.family: ModelFamily[Any] = family_of(self.model_config)

    def _resolve_config(self) -> Any:
        o = self.options
        wanted = o.family.config_class
        if o.source_checkpoint is not None:
            hf = json.loads((o.source_checkpoint / "config.json").read_text())
            config = config_from_hf(hf, **(o.architecture or {}))
            if not isinstance(config, wanted):
                raise ValueError(f"source_checkpoint holds a {type(config).__name__}, not {wanted.__name__}")
            return config
        return wanted.model_validate(o.architecture)

    @property
    def base_model_name_or_path(self) -> str | None:
        """What an adapter trained on this model names as its base: the source checkpoint's absolute path."""
        source = self.options.source_checkpoint
        return str(source.resolve()) if source is not None else None

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.options.dtype)  # type: ignore[no-any-return]

    def flops_per_token(self, seq_len: int) -> float:
        """The `ModelFlops` trait, from the family's cost model."""
        return self.family.flops_per_token(self.model_config, seq_len)

    def stage_layer_counts(self, num_stages: int) -> tuple[int, ...]:
        """The decoder layers of each of `num_stages` pipeline stages (`model.options.parallel.stage_split`);
        ValueError naming what cannot be split."""
        costs = self.family.stage_costs
        config = self.model_config
        return build_stage_split(
            self.options.parallel.stage_split,
            config.num_layers,
            num_stages,
            None if costs is None else lambda seq_len: costs(config, seq_len),
        )

    def build_stage(self, stage: PipelineStageInfo) -> nn.Module:
        if stage.num_stages > 1 and stage.layer_counts is None:
            stage = replace(stage, layer_counts=self.stage_layer_counts(stage.num_stages))
        module = self.family.build_causal_lm(self.model_config, stage)
        for sub in module.modules():
            if isinstance(sub, MoELayer):
                sub.aux_loss_per_token = True  # the causal-LM loss is a token sum divided by the token count
        return module.to(self.dtype)

    def parallelize(self, module: nn.Module, ctx: DistributedContext) -> None:
        """The family's plan: expert, tensor, context, then data parallelism as the mesh asks."""
        if ctx.is_distributed:
            self.family.parallelize(module, ctx, self.options.parallel, self.dtype)

    def initialize(self, module: nn.Module, ctx: DistributedContext) -> None:
        if not isinstance(module, ModuleLateInit):
            raise TypeError(f"{type(module).__name__} has no reset_parameters(); it cannot be built on meta")
        module.reset_parameters()
        source = self.options.source_checkpoint
        if source is None:
            return
        key_to_file, _ = resolve_checkpoint(source)
        keys = {k for f in set(key_to_file.values()) for k in read_header(f).entries if k in key_to_file}
        mapper = hf_to_d9d_mapper_for(self.model_config, keys)
        load_model_state(source, module, mapper, strict=True, allow_cast=True)

    def export(self, modules: Sequence[nn.Module], ctx: DistributedContext, path: Path) -> None:
        """All local stages and config.json in one atomic, distributed save (replicas written once), with the
        source checkpoint's tokenizer and generation-config files when it has them."""
        config_json = json.dumps(config_to_hf(self.model_config), indent=2) + "\n"
        extra: dict[str, str | bytes] = {
            **side_files(self.options.source_checkpoint),
            "config.json": config_json,
        }
        save_model_state(
            path,
            list(modules),
            d9d_to_hf_mapper(self.model_config),
            distributed=ctx.is_distributed,
            overwrite=True,
            extra_files=extra,
        )

    def subscribe(
        self,
        events: EventBus,
        modules: Sequence[nn.Module],
        ctx: DistributedContext,
        metrics: StepMetrics,
    ) -> None:
        routers = [
            (name, m) for module in modules for name, m in module.named_modules() if isinstance(m, TopKRouter)
        ]
        # Under pipelining a rank may hold no MoE layer while others do: it balances nothing, but joins the
        # gather of the logged metrics over the stages.
        layers = model_moe_layers(routers, ctx)
        if layers:
            balancer = ExpertLoadBalancer(routers, ctx, metrics, MoEMetrics(modules), layers)
            events.subscribe(OptimizerStepFinished, lambda event: balancer.after_optimizer_step(event.step))
            events.subscribe(StepSkipped, lambda event: balancer.drop_step())
            events.subscribe(StepRepeated, lambda event: balancer.drop_step())


def causal_lm_flops_per_token(config: BaseModel, seq_len: int) -> float:
    """Training FLOPs per token of a family's causal LM (its cost model; embedding lookups and norms are
    free)."""
    return family_of(config).flops_per_token(config, seq_len)


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^0-9A-Za-z]+", name))


_C = TypeVar("_C", bound=type)


@cache
def family_provider(family: ModelFamily[Any]) -> type[CausalLMProvider]:
    """The provider class of `family`: what `model.provider: <family.name>` builds, and what a user family
    names as a plug-in (`provider: mypkg.family:Provider` with `Provider = family_provider(MY_FAMILY)`), so it
    gets the built-ins' dry run, preflight and Hugging Face import/export."""
    camel = _camel(family.name)
    options = type(f"{camel}Options", (CausalLMOptions,), {"family": family, "__module__": __name__})
    provider = type(f"{camel}Provider", (CausalLMProvider,), {"Config": options, "__module__": __name__})
    _importable(options)
    return _importable(provider)


def _importable(cls: _C) -> _C:
    """Make a class built here at run time a module attribute, so that pickle finds it by name: a config
    sent to Ray actors then arrives as instances of the same classes (sent by value, they became copies
    that pydantic's serializer warned about on every run). The first class of a name keeps it."""
    globals().setdefault(cls.__name__, cls)
    return cls


def builtin_provider(name: str) -> type[CausalLMProvider]:
    """The provider class of the registered family `name` (`qwen3`, `qwen3_moe`, ...)."""
    for family in families():
        if family.name == name:
            return family_provider(family)
    raise KeyError(f"no model family {name!r}")


# -- the `model` section's members (without the peft wrapper, which `d9d.engine.registry` adds) ------------


class BuiltinModel(BuiltinComponent):
    """A built-in family's section; each family's member narrows `provider` and `options`."""

    options: CausalLMOptions


def _family_section(family: ModelFamily[Any]) -> type[BuiltinModel]:
    provider = cast(Any, Literal)[family.name]
    return _importable(
        create_model(
            f"{_camel(family.name)}Section",
            __base__=BuiltinModel,
            __module__=__name__,
            provider=(provider, ...),
            options=(family_provider(family).Config, ...),
        )
    )


FAMILY_SECTIONS: dict[str, type[BuiltinModel]] = {f.name: _family_section(f) for f in families()}
MODEL_BUILTINS = (*FAMILY_SECTIONS, "peft")


class ModelPlugin(PluginSpec):
    kind: ClassVar[str] = "model"
    protocol: ClassVar[type] = ModelProvider
    builtins: ClassVar[tuple[str, ...]] = MODEL_BUILTINS


def model_members() -> tuple[Any, ...]:
    """The section's union members, each tagged by its provider name (for `Annotated[Union[...], ...]`)."""
    return tuple(Annotated[section, tag(name)] for name, section in FAMILY_SECTIONS.items())


if TYPE_CHECKING:
    BaseModelComponent = BuiltinModel | ModelPlugin
else:
    BaseModelComponent = Annotated[
        Union[(*model_members(), Annotated[ModelPlugin, Tag(PLUGIN_TAG)])],
        Discriminator(provider_tag(tuple(FAMILY_SECTIONS))),
    ]


def build_base_model(component: BuiltinModel | ModelPlugin, field: str) -> ModelProvider:
    match component:
        case BuiltinModel():
            return family_provider(component.options.family)(component.options)
        case ModelPlugin():
            provider = component.instantiate(field)
            assert isinstance(provider, ModelProvider)  # checked against the protocol at config time
            return provider


def _layer_name(router_name: str) -> str:
    """The MoE layer a router belongs to (`model.layers.3.mlp` for `model.layers.3.mlp.gate`)."""
    return router_name.rpartition(".")[0] or router_name


def _layer_order(name: str) -> tuple[str | int, ...]:
    """Sort key: the numbers in a name compared as numbers (`layers.2` before `layers.10`)."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name)))


def _pipeline_group(ctx: DistributedContext) -> torch.distributed.ProcessGroup | None:
    if not ctx.is_distributed or ctx.params.pipeline_parallel == 1:
        return None
    return ctx.mesh_for(MeshDomain.REGULAR).get_group("pp")


def model_moe_layers(
    routers: Sequence[tuple[str, TopKRouter]], ctx: DistributedContext
) -> list[tuple[str, int]]:
    """(name, experts) of every MoE layer of the whole model, in layer order: the local stages' routers, and
    under pipelining every pipeline rank's (one gather over pp, at setup; every rank calls it). Names must
    be unique over the stages (the decoders name layers by their global index): the logged per-layer metrics
    are keyed by them."""
    local = [(_layer_name(name), router.num_experts) for name, router in routers]
    group = _pipeline_group(ctx)
    if group is None:
        return local
    layers = [layer for part in all_gather_object(local, group=group) for layer in part]
    names = [name for name, _ in layers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"MoE layers {repeated} are named alike on several pipeline stages; their logged metrics would "
            "mix: name a stage's layers by their global index (as `DecoderBackbone` does)"
        )
    return sorted(layers, key=lambda layer: _layer_order(layer[0]))


class ExpertLoadBalancer:
    """After each optimizer step: sum every router's expert load over the ranks that saw different tokens,
    update the aux-loss-free expert bias from it (identically on every replica), and record balance metrics.

    Ranks that route different tokens: data-parallel and context-parallel ranks, and tensor-parallel ranks,
    since the plan runs MoE layers token-parallel over tp (each tp rank routes its share of the sequence,
    `parallelize_moe_tp`); summing over tp keeps the bias identical on the tp ranks and equal to tp 1's.

    Under pipelining each rank holds some of the layers (`layers`: the whole model's, `model_moe_layers`):
    their reduced loads and balancing-loss statistics are summed over pp into one `[layers, experts + 2]`
    table (each layer's row filled by the rank that holds it, zeros elsewhere) so the logging rank records
    every stage's layers — the values one process running the whole model logs.
    """

    def __init__(
        self,
        routers: Sequence[tuple[str, TopKRouter]],
        ctx: DistributedContext,
        metrics: StepMetrics,
        moe_metrics: MoEMetrics,
        layers: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        self.routers = routers
        self.ctx = ctx
        self.metrics = metrics
        self.moe_metrics = moe_metrics
        self.names = [_layer_name(name) for name, _ in routers]
        self.pp_group = _pipeline_group(ctx)
        self.layers = (
            list(layers) if layers is not None else [(_layer_name(n), r.num_experts) for n, r in routers]
        )
        if self.pp_group is not None:
            unknown = sorted({name for name, _ in moe_metrics.layers} - set(self.names))
            if unknown:
                raise ValueError(f"MoE layers {unknown} have no router named `<layer>.<router>`")
            row = {name: i for i, (name, _) in enumerate(self.layers)}
            # where this rank's layers go in the table (a device index, made once)
            self._rows = torch.tensor([row[n] for n in self.names], dtype=torch.int64, device=ctx.device)
            self._width = max(experts for _, experts in self.layers)

    @torch.no_grad()
    def drop_step(self) -> None:
        """A step without an update (non-finite, or run again): its load does not move the bias, and its
        balancing-loss statistics are not reported."""
        for _, router in self.routers:
            router.reset_expert_load()
        take_aux_loss_stats(self.moe_metrics.layers)

    def _global_aux_stats(self, stats: AuxLossStats) -> AuxLossStats:
        """Each layer's [balancing-loss sum, forwards] summed over the data-parallel ranks, so the logged
        mean covers every microbatch of the step, not rank 0's (one small all-reduce, no host read). Not over
        tp and cp: their ranks each computed the same whole-microbatch loss (`shares_tokens_with`)."""
        if not stats or not self.ctx.is_distributed or self.ctx.params.data_parallel == 1:
            return stats
        stacked = torch.stack([s for _, s in stats])
        self._sum_over_batch(stacked, "dp")
        return [(name, s) for (name, _), s in zip(stats, stacked, strict=True)]

    def _sum_over_batch(self, tensor: torch.Tensor, *dims: str) -> None:
        """All-reduce `tensor` in place over each of the batch mesh's `dims` ("dp", "cp") that has ranks."""
        sizes = {"dp": self.ctx.params.data_parallel, "cp": self.ctx.params.context_parallel}
        batch = self.ctx.mesh_for(MeshDomain.BATCH)
        for dim in dims:
            if sizes[dim] > 1:
                torch.distributed.all_reduce(tensor, group=batch.get_group(dim))

    def _over_stages(self, loads: torch.Tensor | None, aux_stats: AuxLossStats) -> torch.Tensor:
        """The whole model's `[layers, width + 2]` table (float64: the counts stay exact): each layer's
        expert loads, then its balancing-loss [sum, forwards]; one all-reduce over pp."""
        assert self.pp_group is not None
        device = self.ctx.device
        block = torch.zeros(len(self.names), self._width + 2, dtype=torch.float64, device=device)
        if loads is not None:
            block[:, : loads.shape[1]] = loads
            present = dict(aux_stats)
            if present:
                none = torch.zeros(2, dtype=torch.float32, device=device)
                block[:, self._width :] = torch.stack([present.get(n, none) for n in self.names])
        table = torch.zeros(len(self.layers), self._width + 2, dtype=torch.float64, device=device)
        table.index_copy_(0, self._rows, block)
        torch.distributed.all_reduce(table, group=self.pp_group)
        return table

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        loads = None
        if self.routers:  # under pipelining a rank may hold none
            loads = torch.stack([r.expert_load for _, r in self.routers])
            if self.ctx.is_distributed:
                self._sum_over_batch(loads, "dp", "cp")
                if self.ctx.params.tensor_parallel > 1:
                    tp_group = self.ctx.mesh_for(MeshDomain.REGULAR).get_group("tp")
                    torch.distributed.all_reduce(loads, group=tp_group)
            for (_, router), load in zip(self.routers, loads, strict=True):
                router.expert_load.copy_(load)
                router.update_expert_bias()
        aux_stats = self._global_aux_stats(take_aux_loss_stats(self.moe_metrics.layers))
        # The metrics are read only on the steps that log them: the loads are queued to the host here and
        # read then. Reading them every step (`.cpu()`) left the GPU idle ~2 ms per step on one H200
        # (the host waited for the optimizer, then had to start the next step from an empty queue).
        if self.pp_group is None:
            assert loads is not None
            on_host = HostCopy(loads)
            names = self.names

            def fill(metrics: StepMetrics) -> None:
                layers = dict(zip(names, on_host.wait(), strict=True))
                self.moe_metrics.record(metrics, layers, step, aux_stats)

        else:
            table = HostCopy(self._over_stages(loads, aux_stats))
            width, layers_of_model = self._width, self.layers

            def fill(metrics: StepMetrics) -> None:
                rows = table.wait()
                layers = {name: rows[i, :experts] for i, (name, experts) in enumerate(layers_of_model)}
                stats = [(name, rows[i, width:]) for i, (name, _) in enumerate(layers_of_model)]
                # a layer that ran no training forward has [0, 0]: left out, as `take_aux_loss_stats` does
                self.moe_metrics.record(metrics, layers, step, [(n, s) for n, s in stats if s[1] > 0])

        self.metrics.defer("moe", fill)
