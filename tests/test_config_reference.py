"""The configuration reference in docs/engine.md: current, complete (every field of every config model
reachable from a job file), readable, and truthful about what is required."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from d9d.cli.commands.config_reference import job_roots
from d9d.cluster.config import ClusterConfig
from d9d.engine.config import TrainConfig
from d9d.engine.config_reference import BEGIN, END, splice
from d9d.models import families

DOC = Path(__file__).parent.parent / "docs" / "engine.md"


def _block() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) : text.index(END)]


def _rows() -> dict[str, list[str]]:
    """Row path -> the rows' [when, type, default] cells (a path can have one row per union member)."""
    rows: dict[str, list[str]] = {}
    for line in _block().splitlines():
        match = re.match(r"^\| `([^`]+)`( \([^|]*\))? \| (.*) \| (.*) \|$", line)
        if match:
            rows.setdefault(match[1], []).append(f"{match[2] or ''} | {match[3]} | {match[4]}")
    return rows


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """Every pydantic model an annotation mentions: through Annotated, unions, lists, tuples, dicts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _models_in(args[0])
    if origin in (typing.Union, types.UnionType, list, tuple, dict, set, frozenset):
        return [m for a in args for m in _models_in(a)]
    return []


def _reachable() -> set[type[BaseModel]]:
    # A built-in causal LM's `architecture` is a mapping validated as its family's config. Only d9d's own
    # families: tests register their own into the same registry, which the reference does not document.
    built_in = [f.config_class for f in families() if f.config_class.__module__.startswith("d9d.")]
    todo: list[type[BaseModel]] = [TrainConfig, ClusterConfig, *built_in]
    seen: set[type[BaseModel]] = set()
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for field in model.model_fields.values():
            todo.extend(_models_in(field.annotation))
    return seen


def test_checked_in_reference_is_the_generated_one() -> None:
    text = DOC.read_text()
    assert splice(text, job_roots()) == text, "run: d9d config-reference --write docs/engine.md"


def test_every_field_of_every_config_model_is_listed() -> None:
    rows = _rows()
    models = _reachable()
    assert len(models) > 40  # the walk really went into providers, unions and lists
    missing = []
    for model in models:
        fields = [field.alias or name for name, field in model.model_fields.items()]
        if not fields:
            continue
        # Somewhere in the reference the model's fields are listed together under one prefix.
        prefixes = {
            p.removesuffix(f".{fields[0]}") for p in rows if p == fields[0] or p.endswith(f".{fields[0]}")
        }
        if not any(all((f"{p}.{f}" if p != fields[0] else f) in rows for f in fields) for p in prefixes):
            missing.append(f"{model.__module__}.{model.__qualname__}: {fields}")
    assert not missing, "\n".join(missing)


def test_the_sections_the_walkthrough_missed() -> None:
    rows = _rows()
    for path in (
        "cluster.num_workers",
        "cluster.resources.gpus",
        "cluster.storage.local_dir",
        "data.options.bucketing_buffer",
        "data.options.pad_to_multiple_of",
        "data.options.epochs",
        "model.options.dtype",
        "model.options.parallel.sequence_parallel",
        "model.options.architecture.num_experts",
        "logging.tracker.tracking_uri",
        "pipelining.stages_per_rank",
        "model.options.method.rank",
    ):
        assert path in rows, path
    assert any("provider `qwen3_moe`" in r for r in rows["model.options.dtype"])
    assert any("provider `text`" in r for r in rows["data.options.epochs"])


def test_types_are_readable_and_required_marks_true() -> None:
    block = _block()
    for raw in ("Annotated", "typing.", "FieldInfo", "<class", "NoneType", "Optional["):
        assert raw not in block, raw
    rows = _rows()
    for name, field in TrainConfig.model_fields.items():
        (row,) = rows[name]
        assert ("**required**" in row.rsplit("|", 1)[-1]) == field.is_required(), (name, row)
    assert rows["task"] == [" | section, one of provider: `causal_lm` \\| `pkg.module:Class` | `causal_lm`"]
    assert rows["optimizer"][0].endswith("| `adamw`")
    assert rows["mesh.pipeline_parallel"] == [" | int ≥ 1 | `1`"]
    assert rows["logging.tracker"][0].startswith(" | section, one of kind: `mlflow`")
