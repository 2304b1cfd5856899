"""A rank's own exception reaches the user (issue 27 item 6, issue 29 deliverable 1): under Ray, the run's
error is the first failing rank's exception, never a missed heartbeat or a peer's broken collective; an
exception that recurs at the same step after a restart is not retried again."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from d9d.cli.main import main
from d9d.cluster import TrainingJob, build_job
from d9d.cluster.follow import follow

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180), pytest.mark.usefixtures("_ray")]


def _job(run_dir: Path, name: str, model: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return {
        "run": {"name": name, "dir": str(run_dir)},
        "mesh": {"data_parallel_replicate": 2},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 8},
        "model": {"provider": "tests.fault_plugins:RaisingLMProvider", "options": model},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2}},
        "checkpointing": {"period": 2, "keep_last": 2},
        "logging": {"progress_bar": "off", "tracker": {"kind": "null"}},
        **sections,
    }


def test_the_failing_ranks_own_exception_is_the_runs_error_and_is_retried_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 raises in backward at step 3 on every attempt, while rank 0 waits for it in the gradient
    all-reduce (and then sees gloo's `Connection closed by peer`). The console, `d9d status` and
    run_summary.json name rank 1's own exception; the second time at step 3 is not retried."""
    job = _job(
        tmp_path,
        "raises",
        {"fault_rank": 1, "fault_steps": [3]},
        cluster={"max_failures": 3, "restart_backoff_s": 0.1},
    )
    console = io.StringIO()
    started = time.monotonic()
    summary = follow(TrainingJob(build_job(job)).start(), out=console, interactive=False)
    elapsed = time.monotonic() - started

    own = "rank 1: InjectedBackwardError: injected in backward of step 3 on rank 1 (step 3)"
    assert summary.status == "failed"
    assert summary.restarts == 1, summary.failures  # one retry, then the same error at the same step
    assert summary.failures == [own, own]
    error = summary.error
    assert error is not None and error.startswith(f"{own}, again after a restart at the same step")
    # The traceback's last lines, down to the raise in the plug-in, and where the whole rank log is.
    assert 'fault_plugins.py", line' in error and "raise InjectedBackwardError" in error
    assert f"rank 1's log: {tmp_path / 'logs' / 'rank1.log'}" in error
    assert "gloo" not in error and "heartbeat" not in error
    # Noticed from the report, not from a heartbeat timeout (10 s) or a hang (step timeout).
    assert elapsed < 60

    out = console.getvalue()
    assert f"attempt failed: {own}" in out
    assert "run raises failed: 2/8 steps, 1 restarts" in out and "again after a restart" in out

    on_disk = json.loads((tmp_path / "run_summary.json").read_text())
    assert on_disk["error"] == error and on_disk["failures"] == [own, own]
    assert "raise InjectedBackwardError" in (tmp_path / "logs" / "rank1.log").read_text()

    unreachable = "http://127.0.0.1:9"  # no Ray jobs API: the live coordinator, else the files
    capsys.readouterr()
    assert main(["status", "raises", "--address", unreachable, "--run-dir", str(tmp_path)]) == 0
    assert own in capsys.readouterr().out
