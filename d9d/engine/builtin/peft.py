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
from typing import Any

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from torch import nn

from d9d.core.context import DistributedContext
from d9d.engine.builtin.models import BaseModelComponent, CausalLMProvider, ModelPlugin, build_base_model
from d9d.engine.errors import UNION_TAG_PREFIX
from d9d.engine.events import EventBus
from d9d.engine.providers import ModelProvider
from d9d.engine.step_metrics import StepMetrics
from d9d.models.hf import d9d_to_hf_mapper, side_files
from d9d.peft import (
    LoRAConfig,
    PeftConfig,
    StackConfig,
    adapted_modules,
    base_view,
    build_peft_method,
    check_peft_exportable,
    check_targets_match,
    inject_and_freeze,
    merged,
    raise_unmatched,
    reset_adapters,
    save_peft_adapter,
)
from d9d.pipeline.api import PipelineStageInfo

ADAPTER_DIR = "adapter"
METHOD_KEY = "model.options.method"  # where the method's config is, for messages


def _has_lora(method: PeftConfig) -> bool:
    if isinstance(method, StackConfig):
        return any(_has_lora(m) for m in method.methods)
    return isinstance(method, LoRAConfig)


def _kinds(method: PeftConfig) -> str:
    if isinstance(method, StackConfig):
        return "stack of " + ", ".join(_kinds(m) for m in method.methods)
    return method.kind


class PeftModelProvider:
    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        # The wrapped model provider (e.g. {provider: qwen3, options: {source_checkpoint: ...}}).
        base: BaseModelComponent
        method: PeftConfig
        # Also write the LoRA adapters in the Hugging Face `peft` layout to `<export dir>/adapter`.
        export_adapters: bool = False
        # The adapters' random initialization: from this seed and each adapted module's name, so they
        # start the same under every layout (a pipeline stage draws only for the layers it holds).
        adapter_seed: int = 0

        @model_validator(mode="wrap")
        @classmethod
        def _base_problems_in_one_line(
            cls, data: Any, handler: ModelWrapValidatorHandler[PeftModelProvider.Config]
        ) -> PeftModelProvider.Config:
            """Problems of the wrapped provider's section read `base.options.x: ...`, one per line part."""
            try:
                return handler(data)
            except ValidationError as e:
                problems = [
                    ".".join(str(p) for p in item["loc"] if not str(p).startswith(UNION_TAG_PREFIX))
                    + f": {item['msg']}"
                    for item in e.errors()
                    if item["loc"] and item["loc"][0] == "base"
                ]
                if not problems:
                    raise
                raise ValueError("; ".join(problems)) from None

        @model_validator(mode="after")
        def _check_base(self) -> PeftModelProvider.Config:
            base = self.base
            if isinstance(base, ModelPlugin) and (
                base.provider == "peft" or issubclass(base.provider_class("base"), PeftModelProvider)
            ):
                raise ValueError(
                    "base.provider: a peft provider cannot wrap another; stack the methods instead"
                )
            return self

        @field_validator("export_adapters")
        @classmethod
        def _check_export_adapters(cls, export_adapters: bool, info: ValidationInfo) -> bool:
            # The peft layout is a LoRA adapter (full-tuned parameters only ride along as
            # modules_to_save): without a lora method there is nothing to write, which the export would
            # otherwise find only at the end of training.
            method = info.data.get("method")  # absent when invalid: that error is reported instead
            if export_adapters and method is not None and not _has_lora(method):
                raise ValueError(
                    "the Hugging Face peft adapter layout needs LoRA adapters, and method "
                    f"({_kinds(method)}) has no lora method; full-tuned weights are in the merged export "
                    "(checkpointing.export_hf_dir): remove export_adapters, or add a lora method"
                )
            return export_adapters

    def __init__(self, config: Config) -> None:
        self.config = config
        self.base: ModelProvider = build_base_model(config.base, "model.options.base")
        self.method = build_peft_method(config.method)
        # Only the catalogue's providers know the Hugging Face layout an adapter export needs.
        self.hf_config: Any = self.base.model_config if isinstance(self.base, CausalLMProvider) else None
        if config.export_adapters and self.hf_config is None:
            raise ValueError(
                "export_adapters needs a base provider with a Hugging Face mapping (a built-in model "
                f"family); {config.base.provider!r} has none"
            )
        self._targets_checked: set[int] = set()

    def check_targets(self, num_stages: int) -> None:
        """Raise a `ValueError` naming each `target_modules` of the method that matches nothing in the whole
        model split into `num_stages` pipeline stages: every stage is built on meta and injected (a
        pattern may miss a stage, e.g. `model\\.norm` all but the last). Deterministic, so every rank
        that calls it raises the same error, before any collective; the config check calls it for the
        built-in bases before any process starts."""
        if num_stages in self._targets_checked:
            return
        results = []
        for index in range(num_stages):
            with torch.device("meta"):
                part = self.base.build_stage(PipelineStageInfo(index, num_stages))
            results.append(inject_and_freeze(part, self.method, require_match=False))
        check_targets_match(results, METHOD_KEY)
        self._targets_checked.add(num_stages)

    def build_stage(self, stage: PipelineStageInfo) -> nn.Module:
        module: nn.Module = self.base.build_stage(stage)
        if stage.num_stages == 1:
            raise_unmatched(inject_and_freeze(module, self.method, require_match=False), METHOD_KEY)
        else:  # a pattern may match on other stages only; it must match on one
            self.check_targets(stage.num_stages)
            inject_and_freeze(module, self.method, require_match=False)
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
        reset_adapters(module, self.config.adapter_seed)

    @property
    def base_model_name_or_path(self) -> str | None:
        """The base model an adapter names (the base provider's Hugging Face source), None when unknown."""
        return self.base.base_model_name_or_path if isinstance(self.base, CausalLMProvider) else None

    def export(self, modules: Sequence[nn.Module], ctx: DistributedContext, path: Path) -> None:
        self.export_merged(modules, ctx, path)
        if self.config.export_adapters:
            self.export_adapter(modules, ctx, path / ADAPTER_DIR)

    def export_merged(self, modules: Sequence[nn.Module], ctx: DistributedContext, path: Path) -> None:
        """The base provider's format with the adapters folded into the weights (the live model keeps
        them)."""
        with ExitStack() as stack:
            for module in modules:
                stack.enter_context(merged(module))
            self.base.export(modules, ctx, path)

    def export_adapter(
        self,
        modules: Sequence[nn.Module],
        ctx: DistributedContext,
        path: Path,
        base_model_name_or_path: str | None = None,
    ) -> None:
        """A Hugging Face `peft` adapter naming its base (default: the base provider's source checkpoint),
        with the source's tokenizer and generation-config files."""
        if self.hf_config is None:
            raise ValueError(
                "a peft adapter needs a base provider with a Hugging Face mapping (a built-in model family); "
                f"{self.config.base.provider!r} has none; export merged weights instead"
            )
        source = self.base.options.source_checkpoint if isinstance(self.base, CausalLMProvider) else None
        save_peft_adapter(
            modules,
            path,
            d9d_to_hf_mapper(self.hf_config),
            ctx=ctx,
            base_model_name_or_path=base_model_name_or_path or self.base_model_name_or_path,
            extra_files=side_files(source),
        )

    def subscribe(
        self,
        events: EventBus,
        modules: Sequence[nn.Module],
        ctx: DistributedContext,
        metrics: StepMetrics,
    ) -> None:
        self.base.subscribe(events, modules, ctx, metrics)
