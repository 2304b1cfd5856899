"""`peft` model provider: a built-in (or any) model provider with a PEFT method injected.

The wrapped provider does everything it always does, on the base model's structure: `build_stage` builds
the base stage on meta and the method is injected right after (still on meta), `initialize` runs the
base's initialization (random or its Hugging Face `source_checkpoint`) through `d9d.peft.base_view` and
then initializes the adapters (LoRA B = 0, so training starts from the base model exactly), `export`
writes the base format with the adapters folded in (`d9d.peft.merged`, the live model keeps them) and,
with `export_adapters`, a Hugging Face `peft` adapter under `<export dir>/adapter`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from torch import nn

from d9d.core.context import DistributedContext
from d9d.engine.config import ComponentConfig
from d9d.engine.events import EventBus
from d9d.engine.providers import ModelProvider
from d9d.engine.registry import build_component, resolve_provider_class
from d9d.models.hf import d9d_to_hf_mapper
from d9d.models.qwen3 import Qwen3Config
from d9d.peft import (
    PeftConfig,
    adapted_modules,
    base_view,
    build_peft_method,
    check_peft_exportable,
    inject_and_freeze,
    merged,
    reset_adapters,
    save_peft_adapter,
)
from d9d.pipeline.api import PipelineStageInfo

ADAPTER_DIR = "adapter"


class PeftModelProvider:
    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        # The wrapped model provider (e.g. {provider: qwen3, options: {source_checkpoint: ...}}).
        base: ComponentConfig
        method: PeftConfig
        # Also write the LoRA adapters in the Hugging Face `peft` layout to `<export dir>/adapter`.
        export_adapters: bool = False

        @model_validator(mode="after")
        def _check_base(self) -> PeftModelProvider.Config:
            cls = resolve_provider_class("model", self.base.provider, "base.provider")
            if cls is PeftModelProvider:
                raise ValueError(
                    "base.provider: a peft provider cannot wrap another; stack the methods instead"
                )
            try:
                cls.Config.model_validate(self.base.options)
            except ValidationError as e:  # one line per problem, with its path under base.options
                problems = [f"base.options.{'.'.join(map(str, i['loc']))}: {i['msg']}" for i in e.errors()]
                raise ValueError("; ".join(problems)) from None
            return self

    def __init__(self, config: Config) -> None:
        self.config = config
        self.base: ModelProvider = build_component("model", config.base, "model.options.base")
        self.method = build_peft_method(config.method)
        hf_config = getattr(self.base, "model_config", None)
        if config.export_adapters and not isinstance(hf_config, Qwen3Config):
            raise ValueError(
                f"export_adapters needs a base provider with a Hugging Face mapping (qwen3, qwen3_moe); "
                f"{config.base.provider!r} has none"
            )
        self.hf_config: Qwen3Config | None = hf_config if isinstance(hf_config, Qwen3Config) else None

    def build_stage(self, stage: PipelineStageInfo) -> nn.Module:
        module: nn.Module = self.base.build_stage(stage)
        inject_and_freeze(module, self.method)
        if self.hf_config is not None and self.config.export_adapters:
            check_peft_exportable(module, d9d_to_hf_mapper(self.hf_config))  # fail now, not after training
        return module

    def parallelize(self, module: nn.Module, ctx: DistributedContext) -> None:
        if ctx.params.tensor_parallel > 1 and adapted_modules(module):
            # TP styles would shard LoRA factors like the weights they sit on; not supported yet
            raise ValueError(
                f"mesh.tensor_parallel={ctx.params.tensor_parallel}: LoRA-adapted layers cannot be tensor-"
                "parallel; use data (replicate/FSDP), expert or pipeline parallelism"
            )
        self.base.parallelize(module, ctx)

    def initialize(self, module: nn.Module, ctx: DistributedContext) -> None:
        with base_view(module):
            self.base.initialize(module, ctx)
        reset_adapters(module)

    def export(self, modules: Sequence[nn.Module], ctx: DistributedContext, path: Path) -> None:
        with ExitStack() as stack:
            for module in modules:
                stack.enter_context(merged(module))
            self.base.export(modules, ctx, path)
        if self.config.export_adapters and self.hf_config is not None:
            save_peft_adapter(modules, path / ADAPTER_DIR, d9d_to_hf_mapper(self.hf_config), ctx=ctx)

    def subscribe(
        self,
        events: EventBus,
        modules: Sequence[nn.Module],
        ctx: DistributedContext,
        metrics: dict[str, float],
    ) -> None:
        subscribe = getattr(self.base, "subscribe", None)
        if subscribe is not None:
            subscribe(events, modules, ctx, metrics)
