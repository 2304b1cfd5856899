"""Built-in model providers: Qwen3 and Qwen3-MoE causal LMs from the d9d catalogue.

Weights come from a random init or a Hugging Face checkpoint (`source_checkpoint`), streamed through the
HF→d9d state mapper directly into the (possibly sharded) stage; `export` writes Hugging Face format back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.engine.errors import prefixed
from d9d.engine.events import EventBus, OptimizerStepFinished, StepSkipped
from d9d.models.hf.config import config_from_hf, config_to_hf
from d9d.models.hf.io import build_causal_lm, side_files
from d9d.models.hf.mapping import d9d_to_hf_mapper, detect_expert_layout, has_expert_bias, hf_to_d9d_mapper
from d9d.models.qwen3 import Qwen3Config, Qwen3StageModel
from d9d.models.qwen3_moe import Qwen3MoEConfig
from d9d.modules.base import ModuleLateInit
from d9d.modules.moe import MoELayer, MoEMetrics, TopKRouter
from d9d.parallel.plans import ParallelPlanConfig, parallelize_qwen3
from d9d.pipeline.api import PipelineStageInfo
from d9d.state import load_model_state, read_header, resolve_checkpoint, save_model_state


class _CausalLMOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    architecture_class: ClassVar[type[Qwen3Config]] = Qwen3Config

    # Architecture (d9d config fields), or None to take it from `source_checkpoint`'s config.json.
    architecture: dict[str, Any] | None = None
    # A Hugging Face directory to initialize from; `architecture` then overrides d9d-only fields.
    source_checkpoint: Path | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    # How data/tensor/expert parallelism is applied (the mesh sizes come from the job's `mesh`).
    parallel: ParallelPlanConfig = Field(default_factory=ParallelPlanConfig)

    @model_validator(mode="after")
    def _need_one(self) -> _CausalLMOptions:
        if self.architecture is None and self.source_checkpoint is None:
            raise ValueError(
                "give `architecture` (random init) or `source_checkpoint` (a Hugging Face directory)"
            )
        if self.source_checkpoint is not None and not (self.source_checkpoint / "config.json").is_file():
            raise ValueError(f"source_checkpoint {self.source_checkpoint} has no config.json")
        if self.source_checkpoint is None:
            try:  # fail at config time, with field names under `architecture`
                self.architecture_class.model_validate(self.architecture)
            except ValidationError as e:
                raise prefixed(e, "architecture") from None
        return self


class CausalLMProvider:
    """What the catalogue's causal LMs share; `model_config` is the architecture (Hugging Face mapping)."""

    def __init__(self, config: _CausalLMOptions) -> None:
        self.options = config
        self.model_config = self._resolve_config()

    def _resolve_config(self) -> Qwen3Config:
        o = self.options
        if o.source_checkpoint is not None:
            hf = json.loads((o.source_checkpoint / "config.json").read_text())
            config = config_from_hf(hf, **(o.architecture or {}))
            wanted = o.architecture_class
            if not isinstance(config, wanted):
                raise ValueError(f"source_checkpoint holds a {type(config).__name__}, not {wanted.__name__}")
            return config
        return o.architecture_class.model_validate(o.architecture)

    @property
    def base_model_name_or_path(self) -> str | None:
        """What an adapter trained on this model names as its base: the source checkpoint's absolute path."""
        source = self.options.source_checkpoint
        return str(source.resolve()) if source is not None else None

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.options.dtype)  # type: ignore[no-any-return]

    def flops_per_token(self, seq_len: int) -> float:
        """The `ModelFlops` trait: 6 × the matmul parameters a token passes through (MoE: the routed experts
        only) + the attention scores, 12 × query width × the mean number of keys per layer."""
        return causal_lm_flops_per_token(self.model_config, seq_len)

    def build_stage(self, stage: PipelineStageInfo) -> nn.Module:
        module = build_causal_lm(self.model_config, stage)
        for sub in module.modules():
            if isinstance(sub, MoELayer):
                sub.aux_loss_per_token = True  # the causal-LM loss is a token sum divided by the token count
        return module.to(self.dtype)

    def parallelize(self, module: nn.Module, ctx: DistributedContext) -> None:
        """Expert, tensor, then data parallelism (replicate / FSDP / HSDP) as the mesh asks."""
        if ctx.is_distributed:
            assert isinstance(module, Qwen3StageModel)
            parallelize_qwen3(module, ctx, self.options.parallel, activation_dtype=self.dtype)

    def initialize(self, module: nn.Module, ctx: DistributedContext) -> None:
        if not isinstance(module, ModuleLateInit):
            raise TypeError(f"{type(module).__name__} has no reset_parameters(); it cannot be built on meta")
        module.reset_parameters()
        source = self.options.source_checkpoint
        if source is None:
            return
        key_to_file, _ = resolve_checkpoint(source)
        keys = {k for f in set(key_to_file.values()) for k in read_header(f).entries if k in key_to_file}
        mapper = hf_to_d9d_mapper(
            self.model_config,
            expert_layout=detect_expert_layout(keys),
            checkpoint_has_lm_head="lm_head.weight" in keys,
            checkpoint_has_expert_bias=has_expert_bias(keys),
        )
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
        metrics: dict[str, float],
    ) -> None:
        routers = [
            (name, m) for module in modules for name, m in module.named_modules() if isinstance(m, TopKRouter)
        ]
        if routers:
            balancer = ExpertLoadBalancer(routers, ctx, metrics, MoEMetrics(modules))
            events.subscribe(OptimizerStepFinished, lambda event: balancer.after_optimizer_step(event.step))
            events.subscribe(StepSkipped, lambda event: balancer.drop_step())


def causal_lm_flops_per_token(config: Qwen3Config, seq_len: int) -> float:
    """Training FLOPs per token of a Qwen3 / Qwen3-MoE causal LM (embedding lookups and norms are free)."""
    h = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    projections = h * (q + 2 * kv) + q * h
    active = config.vocab_size * h  # the LM head, tied or not
    attention = 0.0
    for layer in range(config.num_layers):
        if isinstance(config, Qwen3MoEConfig) and config.is_moe_layer(layer):
            ffn = 3 * h * config.moe_intermediate_size * config.num_experts_per_tok + h * config.num_experts
        else:
            ffn = 3 * h * config.intermediate_size
        active += projections + ffn
        # Keys a query sees, on average over the sequence: T/2 under the causal mask, about w (1 - w/2T)
        # with a sliding window w < T.
        window = config.layer_window(layer)
        keys = seq_len / 2 if window is None or window >= seq_len else window * (1 - window / (2 * seq_len))
        # QK^T and AV: 2 × 2 × q FLOPs per key forward; forward + backward: 3 times that.
        attention += 12 * q * keys
    return 6.0 * active + attention


class ExpertLoadBalancer:
    """After each optimizer step: sum every router's expert load over the ranks that saw different tokens,
    update the aux-loss-free expert bias from it (identically on every replica), and record balance metrics.

    Ranks that route different tokens: data-parallel and context-parallel ranks, and tensor-parallel ranks,
    since the plan runs MoE layers token-parallel over tp (each tp rank routes its share of the sequence,
    `parallelize_moe_tp`); summing over tp keeps the bias identical on the tp ranks and equal to tp 1's.
    """

    def __init__(
        self,
        routers: Sequence[tuple[str, TopKRouter]],
        ctx: DistributedContext,
        metrics: dict[str, float],
        moe_metrics: MoEMetrics,
    ) -> None:
        self.routers = routers
        self.ctx = ctx
        self.metrics = metrics
        self.moe_metrics = moe_metrics

    @torch.no_grad()
    def drop_step(self) -> None:
        """A step without an update (non-finite): its load does not move the bias."""
        for _, router in self.routers:
            router.reset_expert_load()

    @torch.no_grad()
    def after_optimizer_step(self, step: int) -> None:
        loads = torch.stack([r.expert_load for _, r in self.routers])
        if self.ctx.is_distributed:
            batch = self.ctx.mesh_for(MeshDomain.BATCH)
            for dim in ("dp", "cp"):
                if batch.size(batch.mesh_dim_names.index(dim)) > 1:  # type: ignore[union-attr]
                    torch.distributed.all_reduce(loads, group=batch.get_group(dim))
            if self.ctx.params.tensor_parallel > 1:
                tp_group = self.ctx.mesh_for(MeshDomain.REGULAR).get_group("tp")
                torch.distributed.all_reduce(loads, group=tp_group)
        for (_, router), load in zip(self.routers, loads, strict=True):
            router.expert_load.copy_(load)
            router.update_expert_bias()
        layers = {
            name.rpartition(".")[0] or name: load for (name, _), load in zip(self.routers, loads, strict=True)
        }
        self.moe_metrics.record(self.metrics, layers, step)


class Qwen3Provider(CausalLMProvider):
    class Config(_CausalLMOptions):
        architecture_class = Qwen3Config


class Qwen3MoEProvider(CausalLMProvider):
    class Config(_CausalLMOptions):
        architecture_class = Qwen3MoEConfig
