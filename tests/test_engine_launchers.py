"""`python -m d9d.engine.launch` (one process) and `torchrun ... -m d9d.engine.launch` (two) agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from d9d.cli.main import main
from d9d.tracking.history import RESTART, RESUMED_FROM, read_history
from tests.engine_fixtures import jsonl_losses, subprocess_env, torchrun_command

pytestmark = pytest.mark.distributed

JOB = {
    "run": {"name": "launch"},
    "mesh": {"data_parallel_replicate": 2},
    "batching": {"global_batch_size": 8, "microbatch_size": 2},
    "trainer": {"total_steps": 5},
    "logging": {"progress_bar": "off"},
    "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
    "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
    "task": {"provider": "tests.engine_fixtures:TokenCETask"},
}


def test_torchrun_matches_single_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(JOB))
    env = subprocess_env(GLOO_SOCKET_IFNAME="lo")
    single = [
        sys.executable,
        "-m",
        "d9d.engine.launch",
        str(job),
        "--set",
        f"run.dir={tmp_path / 'one'}",
        "--set",
        "mesh.data_parallel_replicate=1",
    ]
    subprocess.run(single, env=env, check=True, capture_output=True, timeout=300)
    torchrun = torchrun_command(job, f"run.dir={tmp_path / 'two'}")
    proc = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, two = jsonl_losses(tmp_path / "one"), jsonl_losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)
    assert (tmp_path / "two" / "checkpoints" / "latest").read_text() == "step-00000005"

    # Both runs are found by `d9d list/status/plot` like any run on Ray: each launcher records itself.
    capsys.readouterr()
    assert main(["list", "--runs-root", str(tmp_path)]) == 0
    rows = {line.split()[-1]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows[str(tmp_path / "one")][:5] == ["launch", "finished", "5", f"{one[-1]:.6g}", "process"]
    assert rows[str(tmp_path / "two")][:5] == ["launch", "finished", "5", f"{two[-1]:.6g}", "torchrun"]
    assert main(["status", "two", "--runs-root", str(tmp_path)]) == 0
    status = capsys.readouterr().out
    assert status.startswith("run launch: finished (torchrun; read from files)")
    assert "step:        5/5" in status and f"loss:        {two[-1]:.4f}" in status
    assert f"checkpoints: {tmp_path / 'two' / 'checkpoints'} (latest commit: step 5)" in status
    assert main(["plot", "one", "--runs-root", str(tmp_path)]) == 0
    assert (tmp_path / "one" / "plots" / "training.png").is_file()

    # Two more steps of the one-process run: it resumes from its commit at step 5, which its history marks.
    more = [*single, "--set", "trainer.total_steps=7"]
    subprocess.run(more, env=env, check=True, capture_output=True, timeout=300)
    history = read_history(tmp_path / "one" / "history.jsonl")
    assert history[RESUMED_FROM] == {6: 5.0} and history[RESTART] == {6: 0.0}
    assert main(["status", "one", "--runs-root", str(tmp_path)]) == 0
    assert "step:        7/7" in capsys.readouterr().out


def test_cpu_affinity_binds_the_launched_rank_and_changes_nothing_it_computes(tmp_path: Path) -> None:
    """`cpu_affinity.mode: exclusive` through `d9d.engine.launch`: the rank (here the second of two on the
    node, as torchrun would number it) binds to its share of the CPUs, logs it, and trains to the losses of
    an unbound run."""
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**JOB, "mesh": {}}))
    runs = {}
    for mode in ("none", "exclusive"):
        cmd = [sys.executable, "-m", "d9d.engine.launch", str(job), "--set", f"run.dir={tmp_path / mode}"]
        cmd += ["--set", f"cpu_affinity.mode={mode}"]
        env = subprocess_env(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
        runs[mode] = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert runs[mode].returncode == 0, runs[mode].stderr[-3000:]
    output = runs["exclusive"].stdout + runs["exclusive"].stderr
    assert "cpu_affinity exclusive:" in output and "(this process's CPUs, share 2 of 2)" in output, output[
        -3000:
    ]
    assert "cpu_affinity" not in runs["none"].stdout + runs["none"].stderr
    assert jsonl_losses(tmp_path / "exclusive") == jsonl_losses(tmp_path / "none")
