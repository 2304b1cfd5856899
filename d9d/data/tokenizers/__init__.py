"""Tokenizers: a dependency-free byte-level one and Hugging Face `tokenizer.json` files."""

from d9d.data.tokenizers.byte import ByteTokenizer
from d9d.data.tokenizers.config import (
    ByteTokenizerConfig,
    HFTokenizerConfig,
    TokenizerConfig,
    build_tokenizer,
)
from d9d.data.tokenizers.hf import HFTokenizer
from d9d.data.tokenizers.protocol import Tokenizer

__all__ = [
    "ByteTokenizer",
    "ByteTokenizerConfig",
    "HFTokenizer",
    "HFTokenizerConfig",
    "Tokenizer",
    "TokenizerConfig",
    "build_tokenizer",
]
