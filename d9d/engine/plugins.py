"""User plug-ins: a provider class named by `package.module:Class` in the job file.

A plug-in is loaded and checked when the config is validated: the class must exist, define a nested pydantic
`Config` (its `options`), and implement every method of its kind's protocol (`d9d.engine.providers`). Each
failure is a `ConfigError` naming the key, so a typo or a half-written provider fails before any process
group or actor exists, not at the first call.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, Tag, ValidationError

from d9d.engine.errors import UNION_TAG_PREFIX, ConfigError, format_validation_error


def protocol_methods(protocol: type) -> list[str]:
    """The public methods a protocol declares (what the engine calls), in declaration order."""
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


def missing_methods(cls: type, protocol: type) -> list[str]:
    return [name for name in protocol_methods(protocol) if not callable(getattr(cls, name, None))]


class PluginSpec(BaseModel):
    """`provider: pkg.module:Class` plus its raw `options`, validated by the class's own `Config`.

    A subclass per provider kind names the protocol the class must implement and the built-in names the
    kind also accepts (for the "unknown provider" message).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: ClassVar[str] = ""
    protocol: ClassVar[type] = object
    builtins: ClassVar[tuple[str, ...]] = ()

    provider: str = Field(min_length=1)
    options: dict[str, Any] = Field(default_factory=dict)

    def provider_class(self, field: str) -> type[Any]:
        """Import and check the class; `field` is the component's dotted key (e.g. `model`)."""
        if ":" not in self.provider:
            known = ", ".join(sorted(self.builtins)) or "none"
            raise ConfigError(
                f"{field}.provider: unknown {self.kind} provider {self.provider!r}; built-ins: {known}; "
                "or give an import path 'pkg.module:Class'"
            )
        module_name, _, attr = self.provider.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(
                f"{field}.provider: cannot import module {module_name!r} for provider {self.provider!r}: {e}"
            ) from None
        cls = vars(module).get(attr)
        if not isinstance(cls, type):
            raise ConfigError(f"{field}.provider: module {module_name!r} has no attribute {attr!r}")
        config_cls = getattr(cls, "Config", None)
        if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
            raise ConfigError(
                f"{field}.provider: provider {self.provider} must define a nested pydantic `Config` class"
            )
        missing = missing_methods(cls, self.protocol)
        if missing:
            raise ConfigError(
                f"{field}.provider: {self.provider} is not a {self.kind} provider "
                f"({self.protocol.__name__}); missing methods: {', '.join(missing)}"
            )
        return cls

    def validated_options(self, cls: type[Any], field: str) -> BaseModel:
        config_cls: type[BaseModel] = cls.Config
        try:
            return config_cls.model_validate(self.options)
        except ValidationError as e:
            raise ConfigError(
                format_validation_error(e, prefix=f"{field}.options", data=self.options)
            ) from None

    def check(self, field: str) -> None:
        """Everything `instantiate` would check, without constructing the provider."""
        self.validated_options(self.provider_class(field), field)

    def instantiate(self, field: str) -> object:
        cls = self.provider_class(field)
        provider: object = cls(self.validated_options(cls, field))
        return provider


# -- the union of built-in components and plug-ins a provider section is -------------------------------


class BuiltinComponent(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: str  # a Literal name in each built-in


PLUGIN_TAG = f"{UNION_TAG_PREFIX}plugin"


def tag(name: str) -> Tag:
    return Tag(f"{UNION_TAG_PREFIX}{name}")


def provider_tag(builtins: tuple[str, ...]) -> Callable[[Any], str]:
    """The union member for a raw section or a built component: its built-in name, else the plug-in."""

    def pick(value: Any) -> str:
        if isinstance(value, dict):
            name = value.get("provider")
        elif isinstance(value, BuiltinComponent | PluginSpec):
            name = value.provider
        else:
            name = None
        return f"{UNION_TAG_PREFIX}{name}" if name in builtins else PLUGIN_TAG

    return pick
