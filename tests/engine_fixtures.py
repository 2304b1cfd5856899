"""Small user-style providers for engine tests: referenced from configs by import path."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Opts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WidthModelProvider:
    class Config(_Opts):
        width: int = Field(8, ge=1)

    def __init__(self, config: Config) -> None:
        self.config = config


class NotAProvider:
    pass
