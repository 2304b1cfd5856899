"""PEFT method configs: a discriminated union on `kind`, resolved by `d9d.peft.build_peft_method`."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Method(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _Targeted(_Method):
    # A regular expression that must match a module's whole qualified name (`re.fullmatch`).
    target_modules: str

    @field_validator("target_modules")
    @classmethod
    def _check_regex(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"not a valid regular expression ({e}): {value!r}") from None
        return value


class LoRAConfig(_Targeted):
    """Low-rank adapters on every `nn.Linear` and grouped-expert projection whose qualified name fully
    matches `target_modules` (expert projections are named `<experts module>.gate_proj` etc.)."""

    kind: Literal["lora"] = "lora"
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)


class FullTuneConfig(_Targeted):
    """Train every parameter of the modules whose qualified name fully matches `target_modules`."""

    kind: Literal["full_tune"] = "full_tune"


class StackConfig(_Method):
    """Several methods applied in order; the trainable parameters are the union of theirs."""

    kind: Literal["stack"] = "stack"
    methods: list[PeftConfig] = Field(min_length=1)


PeftConfig = Annotated[LoRAConfig | FullTuneConfig | StackConfig, Field(discriminator="kind")]
StackConfig.model_rebuild()
