"""Hugging Face `datasets` as a document source: a `save_to_disk` directory, parquet, arrow or json-lines
files, read in memory-mapped random access or streamed.

The documents are the strings of one column, numbered in the dataset's row order; that number is the global
sample index the sharding layer deals out and checkpoints, exactly as for `FileDocuments`.

- Random access (`streaming=False`): Arrow tables are memory-mapped, so `docs[i]` reads one row and memory
  stays flat. Files (parquet/json) are converted once into the `datasets` Arrow cache.
- Streaming (`streaming=True`): nothing is converted or cached; rows are read in order. Access is forward
  only: asking for a row behind the reader restarts it from the first row, so a resume at sample `n` reads
  (and discards) `n` rows once. Every data-parallel rank reads the whole stream and keeps its share. The
  row count is needed up front (the sharding layer deals a known number of samples): parquet footers give
  it for free, other formats are counted in one pass at construction.

`datasets` is imported lazily: it is an optional dependency (`pip install 'd9d[hf]'`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from d9d.data.state import check_state_matches

HFFormat = Literal["auto", "disk", "parquet", "arrow", "json"]

_SUFFIX_FORMATS: dict[str, Literal["parquet", "arrow", "json"]] = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
}
# What `datasets.load_from_disk` leaves in a directory: a Dataset or a DatasetDict.
_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the Hugging Face dataset source needs `datasets` (pip install 'd9d[hf]')") from e
    return datasets


def resolve_format(paths: Sequence[Path], fmt: HFFormat) -> Literal["disk", "parquet", "arrow", "json"]:
    """The concrete format of `paths`, checking that they exist; errors name the path and what was
    expected."""
    if not paths:
        raise ValueError("no dataset paths given")
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"dataset path {path} does not exist")
    if fmt == "disk" or (fmt == "auto" and len(paths) == 1 and paths[0].is_dir()):
        if len(paths) != 1 or not paths[0].is_dir():
            raise ValueError(
                "format 'disk' takes one directory written by Dataset.save_to_disk, got "
                f"{list(map(str, paths))}"
            )
        if not any((paths[0] / marker).is_file() for marker in _DISK_MARKERS):
            raise ValueError(
                f"dataset directory {paths[0]} was not written by Dataset.save_to_disk (expected one of "
                f"{', '.join(_DISK_MARKERS)} in it); for data files list the files themselves"
            )
        return "disk"
    for path in paths:
        if path.is_dir():
            raise ValueError(f"dataset path {path} is a directory; list its data files, or use format 'disk'")
    if fmt != "auto":
        return fmt
    found = {_SUFFIX_FORMATS.get(p.suffix) for p in paths}
    if None in found:
        unknown = [str(p) for p in paths if p.suffix not in _SUFFIX_FORMATS]
        raise ValueError(
            f"cannot tell the format of {unknown} from the suffix (expected one of "
            f"{', '.join(sorted(_SUFFIX_FORMATS))}); set format explicitly"
        )
    if len(found) != 1:
        raise ValueError(f"paths mix formats {sorted(str(f) for f in found)}; set format or split them")
    resolved = found.pop()
    assert resolved is not None
    return resolved


def _pick_split(loaded: Any, split: str | None, where: str) -> Any:
    datasets = _datasets()
    if isinstance(loaded, datasets.DatasetDict | datasets.IterableDatasetDict):
        names = sorted(loaded)
        if split is None:
            if len(names) != 1:
                raise ValueError(f"{where} holds the splits {names}; choose one with split")
            split = names[0]
        if split not in loaded:
            raise ValueError(f"{where} has no split {split!r} (splits: {names})")
        return loaded[split]
    if split not in (None, "train"):
        raise ValueError(f"{where} is a single split ('train'); split={split!r} does not exist in it")
    return loaded


def open_hf_dataset(
    paths: Sequence[Path],
    fmt: HFFormat,
    split: str | None,
    *,
    streaming: bool,
    cache_dir: Path | None = None,
) -> tuple[Any, str]:
    """(a `datasets.Dataset` or `IterableDataset`, a description for errors)."""
    datasets = _datasets()
    kind = resolve_format(paths, fmt)
    where = f"dataset {', '.join(map(str, paths))}"
    if kind == "disk":
        loaded = _pick_split(datasets.load_from_disk(str(paths[0])), split, where)
        return (loaded.to_iterable_dataset() if streaming else loaded), where
    loaded = datasets.load_dataset(
        kind,
        data_files=[str(p) for p in paths],
        streaming=streaming,
        cache_dir=None if cache_dir is None else str(cache_dir),
    )
    return _pick_split(loaded, split, where), where


def check_column(dataset: Any, column: str, where: str) -> None:
    """`column` exists and holds strings: from the features, or from the first row when a streamed json
    file has no schema before it is read."""
    features = dataset.features
    if features is None:
        first = next(iter(dataset), None)
        if first is None:
            raise ValueError(f"{where} has no rows")
        if column not in first:
            raise ValueError(f"{where} has no column {column!r} (columns: {sorted(first)})")
        if not isinstance(first[column], str):
            raise ValueError(
                f"{where}: column {column!r} holds {type(first[column]).__name__}, expected strings"
            )
        return
    if column not in features:
        raise ValueError(f"{where} has no column {column!r} (columns: {sorted(features)})")
    feature = features[column]
    dtype = feature.dtype if isinstance(feature, _datasets().Value) else type(feature).__name__
    if dtype not in ("string", "large_string"):
        raise ValueError(f"{where}: column {column!r} holds {dtype}, expected strings")


def _disk_fingerprint(directory: Path, split: str | None) -> dict[str, Any]:
    """What tells one `save_to_disk` table from another without reading it: the fingerprint `datasets`
    records in the split's `state.json` (`_fingerprint`: for a table built in memory a hash of its content,
    after a transform a hash of the transform and the previous fingerprint) and the names and sizes of its
    Arrow files. Only JSON is parsed; nothing is unpickled or memory-mapped."""
    split_dir = directory
    if not (directory / "state.json").is_file():  # a DatasetDict: one sub-directory per split
        splits = json.loads((directory / "dataset_dict.json").read_text())["splits"]
        split_dir = directory / (split if split is not None else splits[0])
    state = json.loads((split_dir / "state.json").read_text())
    return {
        "fingerprint": state.get("_fingerprint"),
        "files": [[p.name, p.stat().st_size] for p in sorted(split_dir.glob("*.arrow"))],
    }


def _count_rows(dataset: Any, paths: Sequence[Path], kind: str) -> int:
    if kind == "parquet":
        import pyarrow.parquet as pq

        return sum(int(pq.ParquetFile(p).metadata.num_rows) for p in paths)
    return sum(1 for _ in dataset)


class HFDocuments:
    """`docs[i]` is the string in `column` of row `i` of a Hugging Face dataset.

    Raises at construction (before any training) for a missing path, an unknown split or column, or a
    column that does not hold strings — each error names the thing and what was expected.
    """

    def __init__(
        self,
        paths: Path | str | Sequence[Path | str],
        *,
        column: str = "text",
        split: str | None = None,
        format: HFFormat = "auto",
        streaming: bool = False,
        cache_dir: Path | str | None = None,
    ) -> None:
        self.paths = [Path(p) for p in ([paths] if isinstance(paths, str | Path) else paths)]
        self.column = column
        self.split = split
        self.streaming = streaming
        self.kind = resolve_format(self.paths, format)
        dataset, where = open_hf_dataset(
            self.paths,
            format,
            split,
            streaming=streaming,
            cache_dir=None if cache_dir is None else Path(cache_dir),
        )
        check_column(dataset, column, where)
        self._where = where
        # only the text column is read (a row of a wide table would otherwise decode every column)
        self._dataset = dataset.select_columns([column])
        if streaming:
            self._length = _count_rows(self._dataset, self.paths, self.kind)
        else:
            self._length = len(self._dataset)
        if self._length == 0:
            raise ValueError(f"{where} has no rows")
        # Streaming reader: the next row index it will yield (forward-only access).
        self._rows: Iterator[Any] | None = None
        self._next = 0

    def __len__(self) -> int:
        return self._length

    def _read_streamed(self, index: int) -> Any:
        if self._rows is None or index < self._next:
            self._rows, self._next = iter(self._dataset), 0
        row = next(itertools.islice(self._rows, index - self._next, None))
        self._next = index + 1
        return row

    def __getitem__(self, index: int) -> str:
        if not 0 <= index < self._length:
            raise IndexError(f"document {index} out of range for {self._length} documents")
        row = self._read_streamed(index) if self.streaming else self._dataset[index]
        value = row[self.column]
        if not isinstance(value, str):
            raise ValueError(
                f"{self._where} row {index}: column {self.column!r} is {type(value).__name__}, "
                "expected a string"
            )
        return value

    # Copies (e.g. into DataLoader workers) start their own reader.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_rows": None, "_next": 0}

    def _fingerprint(self) -> dict[str, Any]:
        files = [[p.name, p.stat().st_size] for p in self.paths if p.is_file()]
        fingerprint: dict[str, Any] = {
            "files": files,
            "format": self.kind,
            "split": self.split,
            "column": self.column,
            "documents": self._length,
        }
        if self.kind == "disk":
            fingerprint["saved"] = _disk_fingerprint(self.paths[0], self.split)
        return fingerprint

    def state_dict(self) -> dict[str, Any]:
        return self._fingerprint()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Positions are row numbers, so a resume is only exact over the same rows of the same column."""
        expected = self._fingerprint()
        if "saved" not in state:
            # Taken before saved directories were fingerprinted: checked as then, so such runs still resume.
            expected.pop("saved", None)
        check_state_matches(f"hf documents of {self._where}", state, expected)


def check_hf_source(
    paths: Sequence[Path | str], *, column: str, split: str | None, format: HFFormat = "auto"
) -> None:
    """What a preflight calls: the checks `HFDocuments` makes at construction, without converting files into
    the Arrow cache or counting rows (files are opened streamed and one row is read)."""
    resolved = [Path(p) for p in paths]
    dataset, where = open_hf_dataset(resolved, format, split, streaming=True)
    check_column(dataset, column, where)
