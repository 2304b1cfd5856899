"""The PEFT method contract and `inject_and_freeze`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from torch import nn


@dataclass(frozen=True)
class UnmatchedTarget:
    """A method's `target_modules` that matched nothing it could use in the module it was injected into.

    `field`: the pattern's key relative to the method's config (`target_modules`, or
    `methods.1.target_modules` inside a stack); `needs`: what the pattern had to match (e.g. "module with
    parameters"); `candidates`: names it could have matched there (not compared: the same target is
    unmatched on several pipeline stages, each with its own candidates)."""

    field: str
    kind: str
    pattern: str
    needs: str
    candidates: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def describe(self, prefix: str = "", where: str = "", candidates: Sequence[str] | None = None) -> str:
        """E.g. `full_tune model.options.method.target_modules 'model\\.nrom' fully matches no module with
        parameters; candidates: ...` (`prefix`: the config key of the method; `where`: e.g. "in any of
        the 2 pipeline stages")."""
        names = list(dict.fromkeys(self.candidates if candidates is None else candidates))
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        key = f"{prefix}.{self.field}" if prefix else self.field
        place = f" {where}" if where else ""
        return (
            f"{self.kind} {key} {self.pattern!r} fully matches no {self.needs}{place}; candidates: "
            f"{shown or 'none'}"
        )


@dataclass(frozen=True)
class InjectionResult:
    """What a method did to a model.

    `trainable`: names of the parameters to train. `added`: state keys the method introduced, which base
    checkpoints do not have. Base keys never change (adapted modules keep the names of the modules they
    replace), so no state-mapper renames exist: a base checkpoint loads into the adapted model through
    `d9d.peft.base_view` with the base model's own mapper. Names, not tensors, because parallelization
    replaces parameter objects after injection; `parameters(model)` looks them up. `unmatched`: the
    targets that matched nothing, when the method was injected with `require_match=False` (a pipeline
    stage, which holds part of the model).
    """

    trainable: frozenset[str]
    added: frozenset[str] = frozenset()
    unmatched: frozenset[UnmatchedTarget] = frozenset()

    def __or__(self, other: InjectionResult) -> InjectionResult:
        return InjectionResult(
            self.trainable | other.trainable, self.added | other.added, self.unmatched | other.unmatched
        )

    def under(self, prefix: str) -> InjectionResult:
        """The same result with each unmatched target's field under `prefix` (a stack's `methods.<i>`)."""
        moved = frozenset(replace(u, field=f"{prefix}.{u.field}") for u in self.unmatched)
        return replace(self, unmatched=moved)

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        params = dict(model.named_parameters(remove_duplicate=False))
        missing = sorted(self.trainable - params.keys())
        if missing:
            raise KeyError(
                f"the model has no parameter(s) {missing[:5]}: it is not the model that was injected"
            )
        unique = {id(params[name]): params[name] for name in sorted(self.trainable)}  # tied aliases once
        return list(unique.values())


class PeftMethod(Protocol):
    def inject(self, model: nn.Module, *, require_match: bool = True) -> InjectionResult:
        """Modify `model` in place (on meta or materialized) and report what to train. A pattern that
        matches nothing raises a `ValueError` naming it, or with `require_match=False` (a pipeline stage:
        the pattern's modules may be on another one) is reported in the result's `unmatched`."""
        ...


def raise_unmatched(result: InjectionResult, prefix: str = "") -> None:
    """Raise a `ValueError` naming each target of `result` that matched nothing (keys under `prefix`)."""
    if result.unmatched:
        raise ValueError("; ".join(u.describe(prefix) for u in sorted(result.unmatched, key=_order)))


def check_targets_match(
    parts: Sequence[InjectionResult], prefix: str = "", what: str = "pipeline stages of the model"
) -> None:
    """The injection results of all parts of one model (its pipeline stages, `require_match=False`):
    raise a `ValueError` naming each target that matched nothing in any of them (keys under `prefix`). A
    pattern may miss a stage; it must hit the whole model, so a typo never trains silently."""
    if not parts:
        raise ValueError("check_targets_match needs the injection results of at least one model part")
    missed = frozenset.intersection(*(r.unmatched for r in parts))
    if not missed:
        return
    problems = []
    for target in sorted(missed, key=_order):
        names = [c for r in parts for u in r.unmatched if u == target for c in u.candidates]
        problems.append(target.describe(prefix, f"in any of {len(parts)} {what}", names))
    raise ValueError("; ".join(problems))


def _order(target: UnmatchedTarget) -> str:
    return target.field


def inject_and_freeze(model: nn.Module, method: PeftMethod, *, require_match: bool = True) -> InjectionResult:
    """Freeze every parameter of `model`, inject `method`, and unfreeze exactly what it trains.
    `require_match=False`: patterns that match nothing here are reported (`unmatched`), not raised."""
    for param in model.parameters():
        param.requires_grad_(False)
    result = method.inject(model, require_match=require_match)
    for param in result.parameters(model):
        param.requires_grad_(True)
    return result
