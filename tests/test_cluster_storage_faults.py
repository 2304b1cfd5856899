"""Storage faults (issue 29, deliverable 5): a stalled store is named on the console while it stalls (which
file, which store, how long), and a full device (ENOSPC) is retried once, after the restart freed the
uncommitted steps, then fails with a clear error."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest

from d9d.cluster import TrainingJob, build_job
from d9d.cluster.control.failure import FailurePolicy, GiveUp, Retry, is_no_space
from d9d.cluster.control.outcome import Failed
from d9d.cluster.follow import follow
from d9d.cluster.reporter import storage_stalls
from d9d.core.inflight import Operation, operations, storage_operation
from d9d.core.storage import location, write_file
from tests.cluster_fixtures import toy_job


def test_writes_are_listed_in_flight_and_stalls_are_said_once_per_period_then_done(tmp_path: Path) -> None:
    seen: list[list[Operation]] = []

    class Slow:  # a write that looks at the registry while it is inside it
        def __init__(self, data: bytes) -> None:
            self.data = data

        def __bytes__(self) -> bytes:
            seen.append(operations())
            return self.data

    write_file(tmp_path / "a.bin", bytes(Slow(b"x")))  # the plain path, for contrast: nothing in flight after
    assert operations() == []
    stalled: dict[int, tuple[Operation, float]] = {}
    with storage_operation("writing", "s3://bucket/runs/r/checkpoints/step-00000004/__1_0.distcp") as op:
        t0 = op.started
        assert storage_stalls(stalled, 10.0, t0 + 5) == []
        assert storage_stalls(stalled, 10.0, t0 + 10) == [
            "storage stalled: writing s3://bucket/runs/r/checkpoints/step-00000004/__1_0.distcp "
            "(s3://bucket) for 10s, still waiting"
        ]
        assert storage_stalls(stalled, 10.0, t0 + 15) == []  # said once per period
        assert len(storage_stalls(stalled, 10.0, t0 + 20)) == 1
    assert storage_stalls(stalled, 10.0, t0 + 22) == [
        "storage: writing s3://bucket/runs/r/checkpoints/step-00000004/__1_0.distcp (s3://bucket) done after "
        "about 22s"
    ]
    assert stalled == {}
    with storage_operation("writing", str(tmp_path / "b")):
        assert [o.store for o in operations()] == ["local disk"]
    # The checkpoint writers register each file as they write it.
    from d9d.engine.checkpoint_io import _HashingFileSystem

    fs = _HashingFileSystem()
    with fs.create_stream(tmp_path / "c.distcp", "wb") as stream:
        assert [o.where for o in operations()] == [str(tmp_path / "c.distcp")]
        stream.write(b"abc")
    assert operations() == [] and location(tmp_path / "c.distcp").read_bytes() == b"abc"


def test_enospc_is_retried_once_then_fails_naming_what_to_do() -> None:
    full = OSError(28, "No space left on device", "/ckpt/step-00000004/shard.pt")
    assert is_no_space(full) and is_no_space(RuntimeError("commit failed")) is False
    try:
        try:
            raise full
        except OSError as e:
            raise RuntimeError("the upload failed") from e
    except RuntimeError as chained:
        assert is_no_space(chained)
    policy = FailurePolicy(max_failures=5, backoff_s=0.0, max_backoff_s=0.0)
    first = Failed(
        "rank 1: OSError: [Errno 28] No space left on device (step 4)", step=4, key="a", no_space=True
    )
    assert isinstance(policy.decide(first), Retry)
    again = Failed(
        "rank 0: OSError: [Errno 28] No space left on device (step 6)", step=6, key="b", no_space=True
    )
    decision = policy.decide(again)
    assert isinstance(decision, GiveUp)
    assert "no space left on the device again, after a restart that freed the uncommitted" in decision.error


@pytest.mark.ray
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("_ray")
def test_a_stalled_store_is_named_on_the_console_while_it_stalls(tmp_path: Path) -> None:
    stall = {"kind": "stall_in_checkpoint", "step": 4, "rank": 1}  # 2.5 s inside the write of its shard
    job = toy_job(
        "stall", tmp_path, steps=6, model={"options": {"faults": [stall]}}, cluster={"storage_stall_s": 1.0}
    )
    console = io.StringIO()
    summary = follow(TrainingJob(build_job(job)).start(), out=console, interactive=False)

    assert summary.status == "finished" and summary.restarts == 0, summary.error
    shard = tmp_path / "checkpoints" / "step-00000004" / "shard-00001.pt"
    out = console.getvalue()
    # "for 1s" when the courier looks on time; on a loaded machine its look can come a second later
    named = re.escape(f"rank 1: storage stalled: writing {shard} (local disk) for ")
    assert re.search(named + r"[12]s, still waiting", out), out
    assert f"rank 1: storage: writing {shard} (local disk) done after about " in out
    assert any(n.startswith("rank 1: storage stalled: writing") for n in summary.notices)


@pytest.mark.ray
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("_ray")
def test_enospc_in_a_save_is_retried_once_then_the_run_fails_clearly(tmp_path: Path) -> None:
    """ENOSPC at different steps on the two attempts (so the same-step rule does not apply): one retry,
    after which the run fails, saying what filled up and what to do."""
    full = [
        {"kind": "enospc_in_checkpoint", "step": 4, "rank": 1, "attempt": 0},
        {"kind": "enospc_in_checkpoint", "step": 6, "rank": 1, "attempt": 1},
    ]
    job = toy_job(
        "full", tmp_path, steps=10, model={"options": {"faults": full}}, cluster={"max_failures": 5}
    )
    console = io.StringIO()
    started = time.monotonic()
    summary = follow(TrainingJob(build_job(job)).start(), out=console, interactive=False)

    assert summary.status == "failed" and summary.restarts == 1
    shard = tmp_path / "checkpoints" / "step-00000006" / "shard-00001.pt"
    assert summary.error is not None
    assert summary.error.startswith(f"rank 1: OSError: [Errno 28] No space left on device: '{shard}'")
    assert "no space left on the device again, after a restart that freed" in summary.error
    assert "no space left on the device: the uncommitted checkpoint steps under" in console.getvalue()
    assert (
        not (tmp_path / "checkpoints" / "step-00000004").exists()
        or (tmp_path / "checkpoints" / "step-00000004" / "manifest.json").exists()
    )
    assert time.monotonic() - started < 120
