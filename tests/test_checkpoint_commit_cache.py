"""A process that committed a step does not hash it again when it resumes from it (a coordinator choosing the
restart's checkpoint), and still notices when the files changed since (docs/engine.md, "Resume semantics")."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import d9d.engine.checkpoint as checkpoint
from d9d.engine.checkpoint import CheckpointError, commit, select_commit, step_dir_name
from d9d.engine.runtime import CheckpointFile, RankCheckpointReport


def _write_step(root: Path, step: int, payloads: dict[str, bytes]) -> list[RankCheckpointReport]:
    step_dir = root / step_dir_name(step)
    step_dir.mkdir(parents=True)
    reports = []
    for rank, (name, data) in enumerate(sorted(payloads.items())):
        (step_dir / name).write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        reports.append(RankCheckpointReport(step, rank, step_dir, (CheckpointFile(name, len(data), digest),)))
    return reports


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    hashed: list[Path] = []
    real = checkpoint.sha256_of

    def counting(path: checkpoint.Location) -> str:
        hashed.append(Path(str(path)))
        return real(path)

    monkeypatch.setattr(checkpoint, "sha256_of", counting)
    return hashed


def test_committed_step_is_chosen_without_hashing_it_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = _write_step(tmp_path, 4, {"a.bin": b"x" * 1000, "b.bin": b"y" * 3000})
    step_dir = commit(tmp_path, 4, reports, keep_last=2)
    hashed = _count_hashes(monkeypatch)
    assert select_commit(tmp_path).step_dir == step_dir
    assert hashed == []


def test_a_file_changed_after_the_commit_is_hashed_and_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reports = _write_step(tmp_path, 4, {"a.bin": b"x" * 1000, "b.bin": b"y" * 3000})
    step_dir = commit(tmp_path, 4, reports, keep_last=2)
    (step_dir / "b.bin").write_bytes(b"z" * 3000)  # same size, other bytes: the stat key moves with mtime
    hashed = _count_hashes(monkeypatch)
    with pytest.raises(CheckpointError, match=r"b\.bin does not match"):
        select_commit(tmp_path, "fail")
    assert step_dir / "b.bin" in hashed
