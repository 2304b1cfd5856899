"""Text and JSON-lines corpora as random-access, tokenized datasets."""

from d9d.data.sources.config import TextDatasetConfig, build_text_dataset
from d9d.data.sources.documents import FileDocuments
from d9d.data.sources.formats import DocumentFormat, JsonlField, TextLines, TextParagraphs
from d9d.data.sources.tokenized import TokenizedDataset

__all__ = [
    "DocumentFormat",
    "FileDocuments",
    "JsonlField",
    "TextDatasetConfig",
    "TextLines",
    "TextParagraphs",
    "TokenizedDataset",
    "build_text_dataset",
]
