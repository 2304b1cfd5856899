"""The provider sections of a job file (`model`, `data`, `task`, `optimizer`, `lr_scheduler`) as typed unions.

Each section is `{provider: <name>, options: {...}}`. A built-in name selects a component whose `options`
are that provider's typed `Config`, validated with the rest of the config; any other name must be a
`package.module:Class` import path and becomes a kind-specific `PluginSpec`, checked against the kind's
protocol by `d9d.engine.registry.validate_components`. One `build_*` per kind turns a section into its
provider with an exhaustive `match`.

The `model` section's members come from the model-family registry (`d9d.models.families()`, one member per
family, built in `d9d.engine.builtin.models`); the union with the `peft` wrapper lives in
`d9d.engine.registry` (the wrapper's options hold a model section themselves).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Discriminator, Field, Tag

from d9d.engine.builtin.causal_lm import CausalLMTask, PerplexityTask
from d9d.engine.builtin.models import MODEL_BUILTINS as MODEL_BUILTINS
from d9d.engine.builtin.models import BaseModelComponent as BaseModelComponent
from d9d.engine.builtin.models import BuiltinModel as BuiltinModel
from d9d.engine.builtin.models import ModelPlugin as ModelPlugin
from d9d.engine.builtin.models import build_base_model as build_base_model
from d9d.engine.builtin.optimizers import (
    AdamWProvider,
    PiecewiseLRProvider,
    SGDProvider,
    StochasticAdamWProvider,
)
from d9d.engine.builtin.text_data import TextDataProvider
from d9d.engine.plugins import PLUGIN_TAG as PLUGIN_TAG
from d9d.engine.plugins import BuiltinComponent as BuiltinComponent
from d9d.engine.plugins import PluginSpec
from d9d.engine.plugins import provider_tag as provider_tag
from d9d.engine.plugins import tag as tag
from d9d.engine.providers import (
    DataProvider,
    InferenceTask,
    LRSchedulerProvider,
    OptimizerProvider,
    TrainTask,
)

# -- data ----------------------------------------------------------------------------------------------


class TextData(BuiltinComponent):
    provider: Literal["text"]
    options: TextDataProvider.Config


class DataPlugin(PluginSpec):
    kind: ClassVar[str] = "data"
    protocol: ClassVar[type] = DataProvider
    builtins: ClassVar[tuple[str, ...]] = ("text",)


DataComponent = Annotated[
    Annotated[TextData, tag("text")] | Annotated[DataPlugin, Tag(PLUGIN_TAG)],
    Discriminator(provider_tag(DataPlugin.builtins)),
]


def build_data(component: TextData | DataPlugin, field: str = "data") -> DataProvider:
    match component:
        case TextData():
            return TextDataProvider(component.options)
        case DataPlugin():
            provider = component.instantiate(field)
            assert isinstance(provider, DataProvider)
            return provider


# -- training task ---------------------------------------------------------------------------------------


class CausalLMTaskComponent(BuiltinComponent):
    provider: Literal["causal_lm"] = "causal_lm"
    options: CausalLMTask.Config = Field(default_factory=CausalLMTask.Config)


class TaskPlugin(PluginSpec):
    kind: ClassVar[str] = "task"
    protocol: ClassVar[type] = TrainTask
    builtins: ClassVar[tuple[str, ...]] = ("causal_lm",)


TaskComponent = Annotated[
    Annotated[CausalLMTaskComponent, tag("causal_lm")] | Annotated[TaskPlugin, Tag(PLUGIN_TAG)],
    Discriminator(provider_tag(TaskPlugin.builtins)),
]


def build_task(component: CausalLMTaskComponent | TaskPlugin, field: str = "task") -> TrainTask:
    match component:
        case CausalLMTaskComponent():
            return CausalLMTask(component.options)
        case TaskPlugin():
            task = component.instantiate(field)
            assert isinstance(task, TrainTask)
            return task


# -- inference task --------------------------------------------------------------------------------------


class PerplexityTaskComponent(BuiltinComponent):
    provider: Literal["perplexity"] = "perplexity"
    options: PerplexityTask.Config = Field(default_factory=PerplexityTask.Config)


class InferenceTaskPlugin(PluginSpec):
    kind: ClassVar[str] = "inference_task"
    protocol: ClassVar[type] = InferenceTask
    builtins: ClassVar[tuple[str, ...]] = ("perplexity",)


InferenceTaskComponent = Annotated[
    Annotated[PerplexityTaskComponent, tag("perplexity")] | Annotated[InferenceTaskPlugin, Tag(PLUGIN_TAG)],
    Discriminator(provider_tag(InferenceTaskPlugin.builtins)),
]


def build_inference_task(
    component: PerplexityTaskComponent | InferenceTaskPlugin, field: str = "task"
) -> InferenceTask:
    match component:
        case PerplexityTaskComponent():
            return PerplexityTask(component.options)
        case InferenceTaskPlugin():
            task = component.instantiate(field)
            assert isinstance(task, InferenceTask)
            return task


# -- optimizer -------------------------------------------------------------------------------------------


class AdamW(BuiltinComponent):
    provider: Literal["adamw"] = "adamw"
    options: AdamWProvider.Config = Field(default_factory=AdamWProvider.Config)


class SGD(BuiltinComponent):
    provider: Literal["sgd"]
    options: SGDProvider.Config = Field(default_factory=SGDProvider.Config)


class StochasticAdamW(BuiltinComponent):
    provider: Literal["stochastic_adamw"]
    options: StochasticAdamWProvider.Config = Field(default_factory=StochasticAdamWProvider.Config)


class OptimizerPlugin(PluginSpec):
    kind: ClassVar[str] = "optimizer"
    protocol: ClassVar[type] = OptimizerProvider
    builtins: ClassVar[tuple[str, ...]] = ("adamw", "sgd", "stochastic_adamw")


OptimizerComponent = Annotated[
    Annotated[AdamW, tag("adamw")]
    | Annotated[SGD, tag("sgd")]
    | Annotated[StochasticAdamW, tag("stochastic_adamw")]
    | Annotated[OptimizerPlugin, Tag(PLUGIN_TAG)],
    Discriminator(provider_tag(OptimizerPlugin.builtins)),
]


def build_optimizer(
    component: AdamW | SGD | StochasticAdamW | OptimizerPlugin, field: str = "optimizer"
) -> OptimizerProvider:
    match component:
        case AdamW():
            return AdamWProvider(component.options)
        case SGD():
            return SGDProvider(component.options)
        case StochasticAdamW():
            return StochasticAdamWProvider(component.options)
        case OptimizerPlugin():
            provider = component.instantiate(field)
            assert isinstance(provider, OptimizerProvider)
            return provider


# -- LR scheduler ----------------------------------------------------------------------------------------


class PiecewiseLR(BuiltinComponent):
    provider: Literal["piecewise"]
    options: PiecewiseLRProvider.Config


class LRSchedulerPlugin(PluginSpec):
    kind: ClassVar[str] = "lr_scheduler"
    protocol: ClassVar[type] = LRSchedulerProvider
    builtins: ClassVar[tuple[str, ...]] = ("piecewise",)


LRSchedulerComponent = Annotated[
    Annotated[PiecewiseLR, tag("piecewise")] | Annotated[LRSchedulerPlugin, Tag(PLUGIN_TAG)],
    Discriminator(provider_tag(LRSchedulerPlugin.builtins)),
]


def build_lr_scheduler(
    component: PiecewiseLR | LRSchedulerPlugin, field: str = "lr_scheduler"
) -> LRSchedulerProvider:
    match component:
        case PiecewiseLR():
            return PiecewiseLRProvider(component.options)
        case LRSchedulerPlugin():
            provider = component.instantiate(field)
            assert isinstance(provider, LRSchedulerProvider)
            return provider
