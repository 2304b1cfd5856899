"""Streaming reader: a checkpoint flows through a mapper file by file, group by group.

Before any data is read the reader resolves the layout (index or single file), checks that every key
the mapper needs is listed and present in its file's header, and plans one sequential pass per file
(needed keys in offset order). While reading, a group fires as soon as its last input arrives and its
inputs are dropped, so memory holds at most the inputs of groups that span files plus one group's
outputs until the consumer lets go of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from d9d.state.errors import CheckpointFormatError, StateMappingError
from d9d.state.io.format import FileHeader, TensorEntry, read_header, read_tensor, resolve_checkpoint
from d9d.state.io.progress import progress_bar
from d9d.state.mapper.base import StateGroup, StateMapper, TensorMap, apply_group


class StateReader:
    """`for key, tensor in StateReader(path, mapper)`: the mapper's outputs, each exactly once."""

    def __init__(self, source: str | Path, mapper: StateMapper, *, progress: bool | None = None) -> None:
        self.source = Path(source)
        self.mapper = mapper
        self.progress = progress
        key_to_file, layout_file = resolve_checkpoint(self.source)
        needed = mapper.inputs()
        missing = sorted(needed - key_to_file.keys())
        if missing:
            raise CheckpointFormatError(
                f"{layout_file}: no entry for {len(missing)} key(s) the mapper needs: {missing[:8]}"
            )
        headers: dict[Path, FileHeader] = {}
        plan: dict[Path, list[tuple[str, TensorEntry]]] = {}
        for key in sorted(needed):
            path = key_to_file[key]
            if path not in headers:
                headers[path] = read_header(path)
            entry = headers[path].entries.get(key)
            if entry is None:
                raise CheckpointFormatError(
                    f"{layout_file} maps {key!r} to {path.name}, which has no such tensor"
                )
            plan.setdefault(path, []).append((key, entry))
        self._plan = {
            path: sorted(items, key=lambda item: item[1].start) for path, items in sorted(plan.items())
        }
        self.total_bytes = sum(e.nbytes for items in self._plan.values() for _, e in items)

    def iter_groups(self) -> Iterator[tuple[StateGroup, TensorMap, frozenset[Path]]]:
        """Each group's outputs with the files its inputs came from (for error messages)."""
        remaining: dict[StateGroup, int] = {}
        owner: dict[str, StateGroup] = {}
        for group in self.mapper.groups():
            remaining[group] = len(group.inputs)
            for key in group.inputs:
                owner[key] = group
        origin: dict[StateGroup, set[Path]] = {g: set() for g in remaining}
        pending: dict[str, torch.Tensor] = {}
        for group, count in remaining.items():
            if count == 0:
                yield group, self._apply(group, {}, frozenset()), frozenset()
        with progress_bar(self.total_bytes, f"loading {self.source.name}", "B", self.progress) as bar:
            for path, items in self._plan.items():
                with open(path, "rb") as f:
                    for key, entry in items:
                        pending[key] = read_tensor(f, path, key, entry)
                        bar.update(entry.nbytes)
                        group = owner[key]
                        origin[group].add(path)
                        remaining[group] -= 1
                        if remaining[group] == 0:
                            files = frozenset(origin.pop(group))
                            # No local keeps the inputs alive while suspended: the consumer owns them.
                            outputs = self._apply(group, {k: pending.pop(k) for k in group.inputs}, files)
                            yield group, outputs, files

    def _apply(self, group: StateGroup, inputs: TensorMap, files: frozenset[Path]) -> TensorMap:
        try:
            return apply_group(self.mapper, group, inputs)
        except StateMappingError as e:
            names = ", ".join(sorted(p.name for p in files)) or "no file"
            raise StateMappingError(f"{e} [inputs read from {names} in {self.source}]") from e

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for _, outputs, _ in self.iter_groups():
            # Hand tensors out one by one and forget them, so the consumer decides how long they live.
            for key in sorted(outputs):
                yield key, outputs.pop(key)


def read_model_state(
    source: str | Path, mapper: StateMapper, *, progress: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream `(target_key, tensor)` pairs; layout errors are raised here, before the first tensor."""
    return iter(StateReader(source, mapper, progress=progress))
