"""A text/jsonl corpus in a job config: files, how to cut them into documents, how to tokenize."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from d9d.data.sources.documents import FileDocuments
from d9d.data.sources.formats import DocumentFormat, JsonlField, TextLines, TextParagraphs
from d9d.data.sources.tokenized import TokenizedDataset
from d9d.data.tokenizers.config import ByteTokenizerConfig, TokenizerConfig, build_tokenizer

_JSONL_SUFFIXES = (".jsonl", ".ndjson")


class TextDatasetConfig(BaseModel):
    """`format="auto"` picks jsonl for `.jsonl`/`.ndjson` files and plain text otherwise; `split` applies to
    text files, `field` to jsonl files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    paths: list[Path] = Field(min_length=1)
    format: Literal["auto", "text", "jsonl"] = "auto"
    split: Literal["line", "paragraph"] = "line"
    field: str = "text"
    tokenizer: TokenizerConfig = Field(default_factory=ByteTokenizerConfig)
    add_bos: bool = True
    add_eos: bool = True
    max_length: int | None = Field(None, ge=2)


def _resolve_format(config: TextDatasetConfig) -> DocumentFormat:
    if config.format == "auto":
        is_jsonl = {p.suffix in _JSONL_SUFFIXES for p in config.paths}
        if len(is_jsonl) != 1:
            listing = ", ".join(str(p) for p in config.paths)
            raise ValueError(
                f"paths mix jsonl and text files ({listing}); set format explicitly or split them"
            )
        use_jsonl = is_jsonl.pop()
    else:
        use_jsonl = config.format == "jsonl"
    if use_jsonl:
        return JsonlField(config.field)
    return TextParagraphs() if config.split == "paragraph" else TextLines()


def build_text_dataset(config: TextDatasetConfig) -> TokenizedDataset:
    return TokenizedDataset(
        FileDocuments(config.paths, _resolve_format(config)),
        build_tokenizer(config.tokenizer),
        add_bos=config.add_bos,
        add_eos=config.add_eos,
        max_length=config.max_length,
    )
