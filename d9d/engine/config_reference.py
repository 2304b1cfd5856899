"""Render the job-config reference (docs/engine.md) from the pydantic schema, so the docs cannot drift.

Every field of every section is a row: nested sections, each member of a discriminated union (rows marked
with the `kind`/`provider` that selects them), each built-in provider's `options`, the element models of
lists, and the architecture fields the built-in causal LMs accept. Types are written for readers (`int ≥ 1`,
`'auto' | 'on'`, `path | None`), and a field is **required** only when pydantic requires it.

The engine knows only `TrainConfig`; the layers above add their own top-level sections (the cluster layer's
`cluster:`) as further roots, so `d9d config-reference` renders the whole job file.
"""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from d9d.engine.builtin.models import family_provider
from d9d.engine.components import BuiltinComponent
from d9d.engine.config import TrainConfig
from d9d.engine.plugins import PluginSpec
from d9d.models.family import families

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"

Root = tuple[str, type[BaseModel]]
"""A top-level section: its key (empty for the engine config, whose fields are top-level) and model."""

ENGINE_ROOTS: tuple[Root, ...] = (("", TrainConfig),)

# Fields typed as a free mapping whose keys are nevertheless a model's fields (validated by the provider):
# each model family's `architecture`.
_MAPPING_SCHEMAS: dict[tuple[type[BaseModel], str], type[BaseModel]] = {
    (family_provider(f).Config, "architecture"): f.config_class for f in families()
}


@dataclass(frozen=True)
class Row:
    path: str
    type: str
    default: str
    when: str = ""  # the union member(s) this row belongs to, e.g. "provider `qwen3`"

    def markdown(self) -> str:
        when = f" ({self.when})" if self.when else ""
        return f"| `{self.path}`{when} | {self.type} | {self.default} |"


# -- annotations --------------------------------------------------------------------------------------


def _split_annotated(annotation: Any) -> tuple[Any, list[Any]]:
    metadata: list[Any] = []
    while typing.get_origin(annotation) is typing.Annotated:
        inner, *extra = typing.get_args(annotation)
        metadata.extend(extra)
        annotation = inner
    return annotation, metadata


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _members(annotation: Any) -> list[Any]:
    """Union members with their Annotated wrappers removed, nested unions flattened."""
    annotation, _ = _split_annotated(annotation)
    if not _is_union(annotation):
        return [annotation]
    return [m for a in typing.get_args(annotation) for m in _members(a)]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _literal_values(annotation: Any) -> tuple[Any, ...] | None:
    annotation, _ = _split_annotated(annotation)
    return typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None


def _discriminator(models: Sequence[type[BaseModel]]) -> str | None:
    """The field every member pins to one Literal value (`kind`, `type`, `provider`)."""
    for name in models[0].model_fields:
        values = [m.model_fields[name].annotation if name in m.model_fields else None for m in models]
        if all(v is not None and len(_literal_values(v) or ()) == 1 for v in values):
            return name
    return None


def _tag(model: type[BaseModel], discriminator: str) -> str:
    if issubclass(model, PluginSpec):
        return "`pkg.module:Class`"
    (value,) = _literal_values(model.model_fields[discriminator].annotation) or ("?",)
    return f"`{value}`"


def _constraints(metadata: Sequence[Any]) -> str:
    parts = []
    for item in metadata:
        match item:
            case annotated_types.Ge(ge=bound):
                parts.append(f"≥ {bound}")
            case annotated_types.Gt(gt=bound):
                parts.append(f"> {bound}")
            case annotated_types.Le(le=bound):
                parts.append(f"≤ {bound}")
            case annotated_types.Lt(lt=bound):
                parts.append(f"< {bound}")
            case annotated_types.MinLen(min_length=1):
                parts.append("non-empty")
            case annotated_types.MinLen(min_length=n):
                parts.append(f"at least {n} long")
            case annotated_types.MaxLen(max_length=n):
                parts.append(f"at most {n} long")
            case _:
                pass
    if not parts:
        return ""
    # "int ≥ 1" but "list of sections, non-empty"
    return (" " if parts[0][0] in "≥>≤<" else ", ") + ", ".join(parts)


def type_name(annotation: Any, field_metadata: Sequence[Any] = ()) -> str:
    """A reader's name for a type: no `Annotated[...]`, no module paths; with the field's bounds."""
    annotation, inner_metadata = _split_annotated(annotation)
    metadata = [*inner_metadata, *field_metadata]
    if _is_union(annotation):
        members = [type_name(m, field_metadata) for m in typing.get_args(annotation)]
        return " \\| ".join(dict.fromkeys(members))
    values = _literal_values(annotation)
    if values is not None:
        return " \\| ".join(f"`{v!r}`" for v in values)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (list, tuple, set, frozenset, Sequence):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            return "[" + ", ".join(type_name(a) for a in args) + "]"
        return f"list[{type_name(args[0]) if args else 'Any'}]{_constraints(metadata)}"
    if origin is dict:
        key, value = args or (str, Any)
        if value is Any:
            return "mapping"
        return f"dict[{type_name(key)}, {type_name(value)}]"
    if annotation is type(None):
        return "None"
    if annotation is Any:
        return "any"
    if annotation is Path:
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{m.value!r}`" for m in annotation)
    if _is_model(annotation):
        return "section"
    name = getattr(annotation, "__name__", str(annotation))
    return f"{name}{_constraints(metadata)}"


# -- defaults -----------------------------------------------------------------------------------------


def _value(value: Any) -> str:
    if isinstance(value, BuiltinComponent):
        return f"`{value.provider}`"
    if isinstance(value, BaseModel):
        pinned = _discriminator([type(value)])
        if pinned is not None:
            return f"`{pinned}: {getattr(value, pinned)}`"
        return "(section defaults)"
    if isinstance(value, enum.Enum):
        return f"`{value.value!r}`"
    if isinstance(value, Path):
        return f"`{str(value)!r}`"
    return f"`{value!r}`"


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default is not PydanticUndefined:
        return _value(field.default)
    assert field.default_factory is not None
    return _value(field.default_factory())  # type: ignore[call-arg]


# -- rows ---------------------------------------------------------------------------------------------


@dataclass
class _Walk:
    """Where each section model (or union of them) was first written out: later uses point back to it."""

    first: dict[object, str]

    def seen(self, key: object, path: str) -> str | None:
        earlier = self.first.get(key)
        if earlier is None:
            self.first[key] = path
        return earlier


def _model_rows(model: type[BaseModel], prefix: str, walk: _Walk, stack: tuple[type, ...]) -> list[Row]:
    rows: list[Row] = []
    for name, field in model.model_fields.items():
        key = field.alias or name  # what a job file spells (`checkpointing.async` is field `async_save`)
        path = f"{prefix}.{key}" if prefix else key
        rows.extend(_field_rows(path, field, walk, (*stack, model)))
        schema = _MAPPING_SCHEMAS.get((model, name))
        if schema is not None:
            earlier = walk.seen(schema, path)
            if earlier is not None:
                rows.append(Row(f"{path}.…", f"the keys of `{earlier}`", "—"))
            else:
                rows.extend(_model_rows(schema, path, walk, (*stack, model)))
    return rows


def _union_rows(
    path: str,
    models: list[type[BaseModel]],
    nullable: bool,
    default: str,
    walk: _Walk,
    stack: tuple[type, ...],
) -> list[Row]:
    components = all(issubclass(m, BuiltinComponent | PluginSpec) for m in models)
    key = "provider" if components else _discriminator(models)
    if key is None:
        raise TypeError(f"{path}: a union of sections without a common Literal field to tell them apart")
    tags = [_tag(m, key) for m in models]
    alternatives = " \\| ".join(tags) + (" \\| None" if nullable else "")
    rows = [Row(path, f"section, one of {key}: {alternatives}", default)]
    earlier = walk.seen(tuple(models), path)
    if earlier is not None or any(m in stack for m in models):
        return [*rows, Row(f"{path}.…", f"as `{earlier or path}`", "—")]
    # Pydantic picks the member by this key, so a given section must name it even where a member defaults it.
    rows.append(Row(f"{path}.{key}", " \\| ".join(tags), "**required** in the section"))
    # Members with identical rows (e.g. two providers sharing an options class) are listed once.
    groups: dict[tuple[Row, ...], list[str]] = {}
    for model, tag in zip(models, tags, strict=True):
        member_rows = tuple(
            row for row in _model_rows(model, path, walk, stack) if row.path != f"{path}.{key}"
        )
        groups.setdefault(member_rows, []).append(tag)
    for member_rows, member_tags in groups.items():
        when = f"{key} {', '.join(member_tags)}"
        rows.extend(
            Row(r.path, r.type, r.default, f"{when}; {r.when}" if r.when else when) for r in member_rows
        )
    return rows


def _field_rows(path: str, field: FieldInfo, walk: _Walk, stack: tuple[type, ...]) -> list[Row]:
    return _annotation_rows(path, field.annotation, field.metadata, default_text(field), walk, stack)


def _annotation_rows(
    path: str,
    annotation: Any,
    metadata: Sequence[Any],
    default: str,
    walk: _Walk,
    stack: tuple[type, ...],
) -> list[Row]:
    members = _members(annotation)
    nullable = type(None) in members
    models = [m for m in members if _is_model(m)]
    if models and len(models) == len(members) - nullable:
        if len(models) > 1:
            return _union_rows(path, models, nullable, default, walk, stack)
        (model,) = models
        kind = "section" + (" \\| None" if nullable else "")
        earlier = walk.seen(model, path)
        if earlier is not None or model in stack:
            return [Row(path, f"{kind}, as `{earlier or path}`", default)]
        return [Row(path, kind, default), *_model_rows(model, path, walk, stack)]
    inner, _ = _split_annotated(annotation)
    origin = typing.get_origin(inner)
    if origin in (list, tuple, dict) and not models:
        args = typing.get_args(inner)
        element = args[-1] if origin is dict else args[0] if args else Any
        if any(_is_model(m) for m in _members(element)):
            element_path = f"{path}.<name>" if origin is dict else f"{path}[]"
            kind = "mapping of sections" if origin is dict else "list of sections"
            return [
                Row(path, f"{kind}{_constraints(metadata)}", default),
                *_annotation_rows(element_path, element, (), "—", walk, stack),
            ]
    return [Row(path, type_name(annotation, metadata), default)]


def reference_rows(roots: Sequence[Root] = ENGINE_ROOTS) -> list[Row]:
    rows: list[Row] = []
    walk = _Walk({})
    for key, model in roots:
        if key:
            rows.append(Row(key, "section", "(section defaults)"))
        rows.extend(_model_rows(model, key, walk, ()))
    return rows


def render_reference(roots: Sequence[Root] = ENGINE_ROOTS) -> str:
    lines = ["| field | type | default |", "|---|---|---|"]
    lines += [row.markdown() for row in reference_rows(roots)]
    return "\n".join(lines)


def splice(document: str, roots: Sequence[Root] = ENGINE_ROOTS) -> str:
    """Replace the block between the reference markers in a Markdown document."""
    head, sep, rest = document.partition(BEGIN)
    if not sep or END not in rest:
        raise ValueError(f"document lacks the {BEGIN} ... {END} markers")
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{render_reference(roots)}\n{END}{tail}"
