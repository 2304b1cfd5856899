"""Resolve providers by built-in name or `package.module:Class` import path, and validate their options.

Resolution and option validation run at config-load time, so an unknown provider or a bad option fails
with its dotted path (`model.options.hidden_size: ...`) before any process group or actor exists.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    from d9d.engine.config import ComponentConfig, TrainConfig

ComponentKind = Literal["model", "data", "task", "optimizer", "lr_scheduler", "inference_task"]

BUILTIN_PROVIDERS: dict[str, dict[str, str]] = {
    "model": {
        "qwen3": "d9d.engine.builtin.models:Qwen3Provider",
        "qwen3_moe": "d9d.engine.builtin.models:Qwen3MoEProvider",
        "peft": "d9d.engine.builtin.peft:PeftModelProvider",
    },
    "data": {"text": "d9d.engine.builtin.text_data:TextDataProvider"},
    "task": {"causal_lm": "d9d.engine.builtin.causal_lm:CausalLMTask"},
    "inference_task": {"perplexity": "d9d.engine.builtin.causal_lm:PerplexityTask"},
    "optimizer": {
        "adamw": "d9d.engine.builtin.optimizers:AdamWProvider",
        "sgd": "d9d.engine.builtin.optimizers:SGDProvider",
        "stochastic_adamw": "d9d.engine.builtin.optimizers:StochasticAdamWProvider",
    },
    "lr_scheduler": {"piecewise": "d9d.engine.builtin.optimizers:PiecewiseLRProvider"},
}


def resolve_provider_class(kind: str, spec: str, field: str) -> type[Any]:
    target = BUILTIN_PROVIDERS.get(kind, {}).get(spec, spec)
    if ":" not in target:
        known = ", ".join(sorted(BUILTIN_PROVIDERS.get(kind, {}))) or "none"
        raise _config_error(
            f"{field}: unknown {kind} provider {spec!r}; built-ins: {known}; "
            "or give an import path 'pkg.module:Class'"
        )
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise _config_error(
            f"{field}: cannot import module {module_name!r} for provider {spec!r}: {e}"
        ) from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise _config_error(f"{field}: module {module_name!r} has no attribute {attr!r}")
    config_cls = getattr(cls, "Config", None)
    if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
        raise _config_error(f"{field}: provider {target} must define a nested pydantic `Config` class")
    resolved: type[Any] = cls
    return resolved


def validate_options(cls: type[Any], options: dict[str, Any], field: str) -> BaseModel:
    from d9d.engine.config import format_validation_error

    try:
        result: BaseModel = cls.Config.model_validate(options)
    except ValidationError as e:
        raise _config_error(format_validation_error(e, prefix=f"{field}.options")) from None
    return result


def build_component(kind: ComponentKind, component: ComponentConfig, field: str) -> Any:
    cls = resolve_provider_class(kind, component.provider, f"{field}.provider")
    return cls(validate_options(cls, component.options, field))


def validate_components(config: TrainConfig) -> None:
    sections: list[tuple[ComponentKind, ComponentConfig | None, str]] = [
        ("model", config.model, "model"),
        ("data", config.data, "data"),
        ("task", config.task, "task"),
        ("optimizer", config.optimizer, "optimizer"),
        ("lr_scheduler", config.lr_scheduler, "lr_scheduler"),
    ]
    for kind, component, field in sections:
        if component is not None:
            cls = resolve_provider_class(kind, component.provider, f"{field}.provider")
            options = validate_options(cls, component.options, field)
            # Options that are only wrong for this run (a schedule longer than the run) fail here too,
            # not at the first step; a provider opts in with `check_run(config)`.
            check = getattr(cls, "check_run", None)
            if check is not None:
                try:
                    check(cls(options), config)
                except ValueError as e:
                    raise _config_error(f"{field}.options: {e}") from None


def _config_error(message: str) -> Exception:
    from d9d.engine.config import ConfigError

    return ConfigError(message)
