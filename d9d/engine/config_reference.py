"""Render the job-config reference (docs/engine.md) from the pydantic schema, so docs cannot drift."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from d9d.engine.components import BuiltinComponent
from d9d.engine.config import TrainConfig
from d9d.engine.plugins import PluginSpec

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _union_members(annotation: Any) -> list[Any]:
    annotation = _unwrap(annotation)
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _union_members(a)]


def _component_names(annotation: Any) -> list[str] | None:
    """The provider names a component union accepts, or None when `annotation` is not one."""
    members = _union_members(annotation)
    component = BuiltinComponent | PluginSpec
    if not all(m is type(None) or (isinstance(m, type) and issubclass(m, component)) for m in members):
        return None
    names = []
    for member in members:
        if member is type(None):
            names.append("None")
        elif issubclass(member, PluginSpec):
            names.append("`pkg.module:Class`")
        else:
            names.extend(f"`{n}`" for n in typing.get_args(member.model_fields["provider"].annotation))
    return names


def _type_name(annotation: Any) -> str:
    annotation = _unwrap(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        value = field.default
        return "—" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BuiltinComponent):
            return f"`{value.provider}`"
        if isinstance(value, BaseModel):
            return "(section defaults)"
        return f"`{value!r}`"
    return "**required**"


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = field.annotation
        components = _component_names(annotation)
        if components is not None:
            choices = " \\| ".join(components)
            rows.append(f"| `{path}` | provider: {choices} | {_default(field)} |")
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append(f"| `{path}` | section | {_default(field)} |")
            rows.extend(_rows(annotation, f"{path}."))
        else:
            rows.append(f"| `{path}` | {_type_name(annotation)} | {_default(field)} |")
    return rows


def render_reference() -> str:
    lines = ["| field | type | default |", "|---|---|---|", *_rows(TrainConfig, "")]
    return "\n".join(lines)


def splice(document: str) -> str:
    """Replace the block between the reference markers in a Markdown document."""
    head, sep, rest = document.partition(BEGIN)
    if not sep or END not in rest:
        raise ValueError(f"document lacks the {BEGIN} ... {END} markers")
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{render_reference()}\n{END}{tail}"


def main() -> None:
    """`python -m d9d.engine.config_reference docs/engine.md` rewrites the reference block in place."""
    import sys
    from pathlib import Path

    for name in sys.argv[1:]:
        path = Path(name)
        path.write_text(splice(path.read_text()))


if __name__ == "__main__":
    main()
