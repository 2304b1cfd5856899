"""The `model` section's union (built-ins, the `peft` wrapper, plug-ins), one `build_model`, and the config-
time check of every plug-in (`validate_components`).

Built-in options are validated with the config tree itself; plug-ins are imported and checked against
their kind's protocol here, so an unknown provider, a missing method or a bad option fails with its dotted
path (`model.options.hidden_size: ...`) before any process group or actor exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, Union

from pydantic import Discriminator, Tag

from d9d.engine.builtin.models import CausalLMProvider, model_members
from d9d.engine.builtin.peft import PeftModelProvider
from d9d.engine.components import (
    PLUGIN_TAG,
    BuiltinComponent,
    BuiltinModel,
    LRSchedulerPlugin,
    ModelPlugin,
    PiecewiseLR,
    build_base_model,
    build_lr_scheduler,
    build_optimizer,
    provider_tag,
    tag,
)
from d9d.engine.errors import ConfigError
from d9d.engine.plugins import PluginSpec
from d9d.engine.providers import ModelArchitecture, ModelProvider, OptimizerModelCheck, OptimizerProvider
from d9d.models.family import check_checkpointing_family
from d9d.models.hf.config import hf_export_gap

if TYPE_CHECKING:
    from d9d.engine.config import TrainConfig


class PeftModel(BuiltinComponent):
    provider: Literal["peft"]
    options: PeftModelProvider.Config


if TYPE_CHECKING:
    ModelComponent = BuiltinModel | PeftModel | ModelPlugin
else:  # one member per registered model family (`d9d.models.families()`), then the wrapper and plug-ins
    ModelComponent = Annotated[
        Union[
            (
                *model_members(),
                Annotated[PeftModel, tag("peft")],
                Annotated[ModelPlugin, Tag(PLUGIN_TAG)],
            )
        ],
        Discriminator(provider_tag(ModelPlugin.builtins)),
    ]


def build_model(component: BuiltinModel | PeftModel | ModelPlugin, field: str = "model") -> ModelProvider:
    match component:
        case PeftModel():
            return PeftModelProvider(component.options)
        case BuiltinModel() | ModelPlugin():
            return build_base_model(component, field)


def export_gap(provider: ModelProvider) -> str | None:
    """Why the provider's Hugging Face export would not reproduce the model's logits, or None (exact, or a
    plug-in, which answers for its own export)."""
    base = provider.base if isinstance(provider, PeftModelProvider) else provider
    return hf_export_gap(base.model_config) if isinstance(base, CausalLMProvider) else None


def plugins(config: TrainConfig) -> list[tuple[str, PluginSpec]]:
    """Every plug-in section of a config with its dotted key (the peft wrapper's base included)."""
    sections: list[tuple[str, object]] = [
        ("model", config.model),
        ("data", config.data),
        ("task", config.task),
        ("optimizer", config.optimizer),
        ("lr_scheduler", config.lr_scheduler),
        ("eval.data", config.eval.data if config.eval is not None else None),
    ]
    if isinstance(config.model, PeftModel):
        sections.append(("model.options.base", config.model.options.base))
    return [(field, c) for field, c in sections if isinstance(c, PluginSpec)]


def check_optimizer_fits(config: TrainConfig, optimizer: OptimizerProvider, model: ModelProvider) -> None:
    """Optimizer options that must fit the whole model (a `no_weight_decay` pattern that matches no
    parameter of any pipeline stage): at config validation, and again on every rank before its stages are
    built (a rank may be started from a config that skipped validation); deterministic, no collective."""
    if isinstance(optimizer, OptimizerModelCheck):
        pp = config.mesh.pipeline_parallel
        try:
            optimizer.check_model(model, pp * config.schedule.stages_per_rank if pp > 1 else 1)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def validate_components(config: TrainConfig) -> None:
    """Import and check every plug-in; ask the LR scheduler whether it fits the run's length."""
    for field, plugin in plugins(config):
        plugin.check(field)
    if isinstance(config.lr_scheduler, PiecewiseLR | LRSchedulerPlugin):
        # Options that are only wrong for this run (a schedule longer than the run) fail here too, not at
        # the first step.
        try:
            build_lr_scheduler(config.lr_scheduler).check_run(config.trainer.total_steps)
        except ValueError as e:
            raise ConfigError(f"lr_scheduler.options: {e}") from None
    model = build_model(config.model)
    if config.activation_checkpointing.mode != "none":
        # a plug-in family's provider (the built-ins are checked with the config tree)
        base = model.base if isinstance(model, PeftModelProvider) else model
        if isinstance(base, ModelArchitecture):
            try:
                check_checkpointing_family(
                    base.family, "model.provider", config.activation_checkpointing.mode
                )
            except ValueError as e:
                raise ConfigError(str(e)) from None
    check_optimizer_fits(config, build_optimizer(config.optimizer), model)
    checkpointing = config.checkpointing
    if checkpointing.export_hf_dir is not None and not checkpointing.export_inexact:
        gap = export_gap(model)
        if gap is not None:
            raise ConfigError(
                f"checkpointing.export_hf_dir: {gap}. Set checkpointing.export_inexact: true to export "
                "anyway (then measure the difference with `d9d export RUN --hf DIR --inexact`), remove "
                "export_hf_dir, or train with expert_bias: false"
            )
