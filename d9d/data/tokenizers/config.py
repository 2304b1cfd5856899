"""Choosing a tokenizer in a job config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.data.tokenizers.byte import ByteTokenizer
from d9d.data.tokenizers.hf import HFTokenizer
from d9d.data.tokenizers.protocol import Tokenizer


class ByteTokenizerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["byte"] = "byte"


class HFTokenizerConfig(BaseModel):
    """`path`: a `tokenizer.json` or a directory holding one. Unset specials come from the sibling
    `tokenizer_config.json` when there is one."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["hf"] = "hf"
    path: Path
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None


TokenizerConfig = Annotated[ByteTokenizerConfig | HFTokenizerConfig, Field(discriminator="kind")]


def build_tokenizer(config: ByteTokenizerConfig | HFTokenizerConfig) -> Tokenizer:
    if isinstance(config, ByteTokenizerConfig):
        return ByteTokenizer()
    return HFTokenizer(
        config.path, bos_token=config.bos_token, eos_token=config.eos_token, pad_token=config.pad_token
    )
