"""A corpus in a job config: text/jsonl files or a Hugging Face dataset, and how to tokenize it.

`DatasetConfig` is the union of the two (`source: files`, the default, or `source: hf`), resolved by
`build_dataset`; `check_dataset` is the cheap validation a preflight runs before any process starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from d9d.data.sources.documents import FileDocuments
from d9d.data.sources.formats import DocumentFormat, JsonlField, TextLines, TextParagraphs
from d9d.data.sources.hf import HFDocuments, HFFormat, check_hf_source
from d9d.data.sources.tokenized import TokenizedDataset
from d9d.data.tokenizers.config import ByteTokenizerConfig, TokenizerConfig, build_tokenizer

_JSONL_SUFFIXES = (".jsonl", ".ndjson")


class TextDatasetConfig(BaseModel):
    """`format="auto"` picks jsonl for `.jsonl`/`.ndjson` files and plain text otherwise; `split` applies to
    text files, `field` to jsonl files."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Literal["files"] = "files"
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


class HFDatasetConfig(BaseModel):
    """A Hugging Face dataset: `paths` is one `Dataset.save_to_disk` directory or parquet/arrow/json-lines
    files (`format="auto"` tells them apart by the directory's files and the suffixes). `split` picks a split
    of a saved `DatasetDict` (None: its only split); `column` holds the text. `streaming` reads the rows in
    order without converting files into the Arrow cache (see `d9d.data.sources.hf`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: Literal["hf"]
    paths: list[Path] = Field(min_length=1)
    format: HFFormat = "auto"
    split: str | None = None
    column: str = "text"
    streaming: bool = False
    # Where files are converted into Arrow tables (None: the `datasets` default, ~/.cache/huggingface).
    cache_dir: Path | None = None
    tokenizer: TokenizerConfig = Field(default_factory=ByteTokenizerConfig)
    add_bos: bool = True
    add_eos: bool = True
    max_length: int | None = Field(None, ge=2)


def _source_tag(value: Any) -> str:
    # `source` may be left out for files (the original, and still the common, form)
    if isinstance(value, dict):
        return str(value.get("source", "files"))
    if isinstance(value, HFDatasetConfig):
        return "hf"
    return "files"


DatasetConfig = Annotated[
    Annotated[TextDatasetConfig, Tag("files")] | Annotated[HFDatasetConfig, Tag("hf")],
    Discriminator(_source_tag),
]


def build_dataset(config: TextDatasetConfig | HFDatasetConfig) -> TokenizedDataset:
    documents: FileDocuments | HFDocuments
    match config:
        case TextDatasetConfig():
            documents = FileDocuments(config.paths, _resolve_format(config))
        case HFDatasetConfig():
            documents = HFDocuments(
                config.paths,
                column=config.column,
                split=config.split,
                format=config.format,
                streaming=config.streaming,
                cache_dir=config.cache_dir,
            )
    return TokenizedDataset(
        documents,
        build_tokenizer(config.tokenizer),
        add_bos=config.add_bos,
        add_eos=config.add_eos,
        max_length=config.max_length,
    )


def build_text_dataset(config: TextDatasetConfig) -> TokenizedDataset:
    return build_dataset(config)


def check_dataset(config: TextDatasetConfig | HFDatasetConfig) -> None:
    """Cheap validation for a preflight: the paths exist, a Hugging Face dataset has the split and column,
    the tokenizer loads and has the special tokens asked for. Raises naming the thing and what was expected;
    nothing is indexed, converted or tokenized."""
    match config:
        case TextDatasetConfig():
            for path in config.paths:
                if not path.is_file():
                    raise FileNotFoundError(f"data file {path} does not exist")
            _resolve_format(config)
        case HFDatasetConfig():
            check_hf_source(config.paths, column=config.column, split=config.split, format=config.format)
    tokenizer = build_tokenizer(config.tokenizer)
    for name, wanted, token_id in (
        ("bos", config.add_bos, tokenizer.bos_id),
        ("eos", config.add_eos, tokenizer.eos_id),
    ):
        if wanted and token_id is None:
            raise ValueError(f"add_{name}=True but tokenizer {tokenizer!r} has no {name} token")
