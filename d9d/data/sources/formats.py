"""How a file is cut into documents and how a document's bytes become text.

A format only finds byte spans and decodes one span; `FileDocuments` owns the files, the index and the
random access, so adding a format (CSV, Parquet rows, ...) does not touch the indexing code.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO, Protocol


class DocumentFormat(Protocol):
    def spans(self, stream: BinaryIO, name: str) -> Iterator[tuple[int, int]]:
        """Byte ranges `[start, end)` of the documents in the file, in order; may validate as it goes."""
        ...

    def text(self, raw: bytes) -> str: ...

    def describe(self) -> str:
        """A stable description for resume checks, e.g. `jsonl(field='text')`."""
        ...


def _lines(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(offset, line without its line ending) for each line."""
    offset = 0
    for line in stream:
        yield offset, line.rstrip(b"\r\n")
        offset += len(line)


class TextLines:
    """One document per non-blank line."""

    def spans(self, stream: BinaryIO, name: str) -> Iterator[tuple[int, int]]:
        for offset, line in _lines(stream):
            if line.strip():
                yield offset, offset + len(line)

    def text(self, raw: bytes) -> str:
        return raw.decode("utf-8", errors="replace")

    def describe(self) -> str:
        return "text(line)"


class TextParagraphs:
    """One document per paragraph: runs of non-blank lines separated by blank lines. Inner line breaks are
    kept as in the file."""

    def spans(self, stream: BinaryIO, name: str) -> Iterator[tuple[int, int]]:
        start: int | None = None
        end = 0
        for offset, line in _lines(stream):
            if line.strip():
                start = offset if start is None else start
                end = offset + len(line)
            elif start is not None:
                yield start, end
                start = None
        if start is not None:
            yield start, end

    def text(self, raw: bytes) -> str:
        return raw.decode("utf-8", errors="replace")

    def describe(self) -> str:
        return "text(paragraph)"


class JsonlField:
    """One document per non-blank line of a JSON-lines file: the string at `field` of each object."""

    def __init__(self, field: str = "text") -> None:
        self.field = field

    def spans(self, stream: BinaryIO, name: str) -> Iterator[tuple[int, int]]:
        for number, (offset, line) in enumerate(_lines(stream), start=1):
            if not line.strip():
                continue
            self._extract(line, f"{name} line {number}")  # validated at index time, before training starts
            yield offset, offset + len(line)

    def _extract(self, raw: bytes, where: str) -> str:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
        if not isinstance(obj, dict) or self.field not in obj:
            keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{where}: no field {self.field!r} (has {keys})")
        value = obj[self.field]
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {self.field!r} is {type(value).__name__}, expected a string")
        return value

    def text(self, raw: bytes) -> str:
        return self._extract(raw, "jsonl document")

    def describe(self) -> str:
        return f"jsonl(field={self.field!r})"
