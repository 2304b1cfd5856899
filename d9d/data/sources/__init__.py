"""Text and JSON-lines files and Hugging Face datasets as random-access, tokenized datasets."""

from d9d.data.sources.config import (
    DatasetConfig,
    HFDatasetConfig,
    TextDatasetConfig,
    build_dataset,
    build_text_dataset,
    check_dataset,
)
from d9d.data.sources.documents import FileDocuments
from d9d.data.sources.formats import DocumentFormat, JsonlField, TextLines, TextParagraphs
from d9d.data.sources.hf import HFDocuments, check_hf_source
from d9d.data.sources.tokenized import TokenizedDataset

__all__ = [
    "DatasetConfig",
    "DocumentFormat",
    "FileDocuments",
    "HFDatasetConfig",
    "HFDocuments",
    "JsonlField",
    "TextDatasetConfig",
    "TextLines",
    "TextParagraphs",
    "TokenizedDataset",
    "build_dataset",
    "build_text_dataset",
    "check_dataset",
    "check_hf_source",
]
