"""The state `d9d list` and `d9d status` show for a run that no launcher recorded the end of: a script that
drove the `Trainer` itself (now `recorded_train`: running, then finished, stopped or failed), a process
that is gone without recording its end (`died`), and a directory with no `run.json` at all (`finished`
when its newest commit is its last step, else `no record`), never `unknown`; and `d9d stop` of such a
launch, through the process its record names, and Ctrl-C (SIGINT) to it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

from d9d.cli.main import main
from d9d.cluster.registry import find_record, records, state_from_files
from d9d.engine.config import load_config, parse_config
from d9d.engine.launch import STOP_SIGNALS, recorded_train, stop_on_signals
from d9d.engine.resume import check_resume
from d9d.engine.runtime import CommandKind, RankResult
from tests.cluster_fixtures import toy_job


def _commit(run: Path, step: int, total_steps: int) -> None:
    step_dir = run / "checkpoints" / f"step-{step:08d}"
    step_dir.mkdir(parents=True)
    (step_dir / "manifest.json").write_text("{}")
    (step_dir / "train_config.json").write_text(json.dumps({"trainer": {"total_steps": total_steps}}))
    (run / "checkpoints" / "latest").write_text(step_dir.name)


def _history(run: Path, steps: range) -> None:
    lines = [{"step": s, "t": time.time(), "values": {"train/loss": 5.0 - s / 10}} for s in steps]
    (run / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def _listed(runs: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, list[str]]:
    assert main(["list", "--runs-root", str(runs)]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    return {row.split()[0]: row.split() for row in rows}


def test_a_run_directory_without_records_shows_what_its_files_tell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script that trained with the `Trainer` and its own `LocalRunReporter` left checkpoints (and,
    with a tracker, a history), no run.json nor run_summary.json: `d9d list` said `unknown`."""
    runs = tmp_path / "runs"
    _commit(runs / "done", 10, 20)
    _commit(runs / "done", 20, 20)  # the last step is committed: it finished
    _commit(runs / "partway", 8, 20)
    _history(runs / "partway", range(1, 12))  # trained past its newest commit
    (runs / "history-only").mkdir(parents=True)
    _history(runs / "history-only", range(1, 6))

    listed = _listed(runs, capsys)
    assert listed["done"][1:3] == ["finished", "20"]
    assert listed["partway"][1:5] == ["no", "record", "11", "3.9"]
    assert listed["history-only"][1:4] == ["no", "record", "5"]
    assert all(row[-3] == "unknown" for row in listed.values())  # the launcher: it left no run.json

    assert main(["status", "done", "--runs-root", str(runs)]) == 0
    out = capsys.readouterr().out
    assert "run done: finished (no run.json; read from files)" in out and "  step:        20/20" in out
    main(["status", "partway", "--runs-root", str(runs)])
    out = capsys.readouterr().out
    assert "run partway: no record (no run.json; read from files)" in out and "  step:        11/20" in out


def _record(run: Path, driver: str, started_at: float) -> None:
    run.mkdir(parents=True)
    record = {
        "run_name": run.name,
        "run_dir": str(run),
        "launch_id": "L1",
        "started_at": started_at,
        "driver": driver,
        "launcher": "script",
        "total_steps": 20,
    }
    (run / "run.json").write_text(json.dumps(record))
    start = {"run_name": run.name, "status": "starting", "steps": 0, "restarts": 0, "launch_id": "L1"}
    (run / "run_summary.json").write_text(json.dumps({**start, "launches": [start]}))


def test_a_launch_without_an_end_is_running_while_its_process_lives(tmp_path: Path) -> None:
    """A launch without Ray that recorded its start but not (yet) its end: `running` while the process
    named in run.json lives on this host, `died` once it is gone (killed before it could record the end),
    `started` when it ran on another host."""
    runs = tmp_path / "runs"
    host = socket.gethostname()
    _record(runs / "alive", f"{host}:{os.getpid()}", time.time())
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    _record(runs / "gone", f"{host}:{int(gone.stdout)}", time.time())
    _record(runs / "elsewhere", f"{host}-not:{os.getpid()}", time.time())
    # A process that reuses the pid later is not the launch's.
    _record(runs / "reused", f"{host}:{os.getpid()}", time.time() - 3600 * 24 * 365)

    states = {r.run_name: state_from_files(r).state for r in records(runs)}
    assert states == {"alive": "running", "gone": "died", "elsewhere": "started", "reused": "died"}


def _trainer(tmp_path: Path, train: object) -> SimpleNamespace:
    job = toy_job("scripted", tmp_path / "run", steps=20)
    del job["cluster"]
    return SimpleNamespace(
        config=parse_config(job, check_components=False),
        progress=SimpleNamespace(step=0),
        train=train,
        commands=SimpleNamespace(
            receive=None
        ),  # `recorded_train` reads the commands through the signals' stop
        reporter=None,
        ctx=None,
    )


def test_a_script_that_records_its_training_shows_how_it_ended(tmp_path: Path) -> None:
    def finished() -> RankResult:
        record = find_record("scripted", run_dir=tmp_path / "run")
        assert record is not None and state_from_files(record).state == "running"  # while it trains
        return RankResult(status="finished", steps=20, final_loss=0.5, tokens_per_s=None)

    result = recorded_train(_trainer(tmp_path, finished))  # type: ignore[arg-type]
    assert result.status == "finished"
    record = find_record("scripted", run_dir=tmp_path / "run")
    assert record is not None and record.launcher == "script" and record.total_steps == 20
    state = state_from_files(record)
    assert (state.state, state.step, state.last_loss) == ("finished", 20, 0.5)

    def fails() -> RankResult:
        raise RuntimeError("boom at step 3")

    with pytest.raises(RuntimeError):
        recorded_train(_trainer(tmp_path, fails))  # type: ignore[arg-type]
    record = find_record("scripted", run_dir=tmp_path / "run")
    assert record is not None and state_from_files(record).state == "failed"
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    assert summary["error"] == "RuntimeError: boom at step 3" and len(summary["launches"]) == 2


# -- d9d stop of a launch without Ray ---------------------------------------------------------------------


_SCRIPT = """
import sys
from pathlib import Path

import torch.distributed as dist

from d9d.core import DistributedContext
from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import load_config
from d9d.engine.launch import recorded_train
from d9d.engine.trainer import Trainer

config = load_config(Path(sys.argv[1]))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ctx = DistributedContext.create(config.mesh, backend="gloo")
progress = config.run_dir / "progress"  # the step reached, for the test to wait on
reporter = LocalRunReporter(
    config.checkpoint_dir, config.checkpointing.keep_last, lambda p: progress.write_text(str(p.step))
)
trainer = Trainer(config, ctx, reporter)
trainer.setup()
result = recorded_train(trainer)
print("trained:", result.status, result.steps, flush=True)
"""


def _launch(
    tmp_path: Path, how: str = "process", log: Path | None = None, **job: Any
) -> tuple[subprocess.Popen[str], Path]:
    """A launch without Ray (`how`: `process`, `torchrun` with two ranks, or `script`: a script's
    `recorded_train`) of a tiny engine job (the launchers' test's) that would train far longer than the test
    waits. Its output: `log`, else a pipe (`proc.communicate()`)."""
    import yaml

    from tests.engine_fixtures import subprocess_env, torchrun_command

    run = tmp_path / "runs" / "proc"
    config = {
        "run": {"name": "proc", "dir": str(run)},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 1_000_000},
        "checkpointing": {"period": 100_000},
        "logging": {"progress_bar": "off"},  # the default tracker: history.jsonl tells the step reached
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        **job,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    command = {
        "process": [sys.executable, "-m", "d9d.engine.launch", str(path)],
        "torchrun": torchrun_command(path),
        "script": [sys.executable, "-c", _SCRIPT, str(path)],
    }[how]
    with open(log, "w") if log is not None else contextlib.nullcontext(subprocess.PIPE) as out:
        proc = subprocess.Popen(
            command,
            env=subprocess_env(GLOO_SOCKET_IFNAME="lo"),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as a terminal gives a command it runs
            # and SIGINT at its default, as a terminal's foreground command has it, also where pytest runs
            # in the background (a non-interactive shell's `&` ignores SIGINT, and children inherit that)
            preexec_fn=_default_sigint,
        )
    return proc, run


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL to the launch's process group and to those of the processes it started: torchrun starts each
    worker in a session of its own, which a signal to its group does not reach, and killing the agent alone
    would leave its workers training their million steps."""
    groups = {proc.pid}
    if proc.poll() is None:  # not reaped: the pid is still the launch's
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    groups.add(os.getpgid(child.pid))
    for group in groups - {os.getpgrp()}:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def _wait_for_step(proc: subprocess.Popen[str], run: Path, step: int) -> None:
    """Until the launch is `running` past `step` (from its history, or the script's progress file)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        record = find_record("proc", run_dir=run)
        if record is not None:
            state = state_from_files(record)
            progress = run / "progress"
            reached = int(progress.read_text() or 0) if progress.is_file() else (state.step or 0)
            if state.state == "running" and reached >= step:
                return
        time.sleep(0.1)
    _kill(proc)
    raise AssertionError(f"never reached step {step}: {proc.communicate()[0][-3000:]}")


@pytest.mark.timeout(240)
def test_d9d_stop_stops_a_process_run_at_a_step_boundary_which_it_commits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc, run = _launch(tmp_path)
    try:
        _wait_for_step(proc, run, 3)
        capsys.readouterr()
        assert main(["stop", "proc", "--runs-root", str(tmp_path / "runs"), "--timeout", "60"]) == 0
        out = capsys.readouterr().out
        # It ended by itself (no SIGKILL), recorded its end and exited as a stop on request does.
        assert proc.wait(timeout=30) == 0
    finally:
        _kill(proc)  # whatever is left of it (torchrun's workers included)
    log = proc.communicate()[0]
    assert "SIGTERM: stopping at the next step boundary" in log, log[-3000:]
    assert f"sent SIGTERM to its process (pid {proc.pid})" in out and "killed" not in out, out
    record = find_record("proc", run_dir=run)
    assert record is not None
    state = state_from_files(record)
    assert state.state == "stopped" and state.step is not None and state.step >= 3, state
    assert out.splitlines()[-1] == f"run proc: stopped after {state.step} steps"
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["stop_reason"] == "SIGTERM"
    # The step it stopped at is committed: a relaunch resumes there.
    assert (run / "checkpoints" / "latest").read_text() == f"step-{state.step:08d}"
    # Stopped: there is nothing to stop any more.
    assert main(["stop", "proc", "--runs-root", str(tmp_path / "runs")]) == 1
    assert capsys.readouterr().err == "d9d stop: run 'proc' is not running (stopped; process launch)\n"


@pytest.mark.timeout(240)
def test_d9d_stop_stops_a_script_that_records_its_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`recorded_train` of a script's own `Trainer` and reporter: the stop reaches its command loop."""
    proc, run = _launch(tmp_path, "script")
    try:
        _wait_for_step(proc, run, 3)
        assert main(["stop", "proc", "--runs-root", str(tmp_path / "runs"), "--timeout", "60"]) == 0
        assert proc.wait(timeout=30) == 0
    finally:
        _kill(proc)  # whatever is left of it (torchrun's workers included)
    log = proc.communicate()[0]
    out = capsys.readouterr().out
    assert f"sent SIGTERM to the script's rank 0 (pid {proc.pid})" in out and "killed" not in out, out
    record = find_record("proc", run_dir=run)
    assert record is not None and record.launcher == "script"
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["status"], summary["stop_reason"]) == ("stopped", "SIGTERM")
    steps = summary["steps"]
    assert f"trained: stopped {steps}\n" in log, log[-3000:]
    assert (run / "checkpoints" / "latest").read_text() == f"step-{steps:08d}"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_d9d_stop_stops_every_rank_of_a_torchrun_launch_at_one_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The record names rank 0's process; the stop reaches rank 1 through rank 0's broadcast of the
    commands, so both stop at one step, which they save together, and torchrun ends without an error."""
    proc, run = _launch(tmp_path, "torchrun", mesh={"data_parallel_replicate": 2})
    try:
        _wait_for_step(proc, run, 3)
        record = find_record("proc", run_dir=run)
        assert record is not None and record.launcher == "torchrun"
        assert int(record.driver.rpartition(":")[2]) != proc.pid  # a worker, not torchrun's agent
        assert main(["stop", "proc", "--runs-root", str(tmp_path / "runs"), "--timeout", "60"]) == 0
        assert proc.wait(timeout=60) == 0
    finally:
        _kill(proc)  # whatever is left of it (torchrun's workers included)
    log = proc.communicate()[0]
    out = capsys.readouterr().out
    assert "sent SIGTERM to torchrun's rank 0" in out and "killed" not in out, out
    state = state_from_files(record)
    assert state.state == "stopped" and state.step is not None and state.step >= 3, (state, log[-3000:])
    assert out.splitlines()[-1] == f"run proc: stopped after {state.step} steps"
    assert (run / "checkpoints" / "latest").read_text() == f"step-{state.step:08d}"


# -- Ctrl-C (SIGINT) to a launch without Ray --------------------------------------------------------------


def test_the_first_sigint_or_sigterm_asks_for_a_stop_and_puts_both_handlers_back(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """In this process (pytest's main thread), with real signals: the first one asks for one STOP named after
    it and puts both handlers back, so a second Ctrl-C raises KeyboardInterrupt, which the launch's record
    then names; a signal ignored before stays ignored."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    # As in a foreground process: an earlier test of this session may have left another SIGTERM handler
    # here (a Ray driver installs one).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with stop_on_signals(0) as stop:
            assert all(signal.getsignal(s) == stop.handle for s in STOP_SIGNALS)
            signal.raise_signal(signal.SIGINT)
            assert stop.reason == "SIGINT"
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            assert [(c.kind, c.values) for c in stop.pending()] == [(CommandKind.STOP, {"reason": "SIGINT"})]
            assert stop.pending() == ()  # once
            with pytest.raises(KeyboardInterrupt) as second:
                signal.raise_signal(signal.SIGINT)
            failure = stop.failure(second.value)
            assert failure == "KeyboardInterrupt: interrupted by a second SIGINT before the step boundary"
        assert capfd.readouterr().err == (
            "d9d: SIGINT: stopping at the next step boundary, which is saved and committed; "
            "a second SIGINT interrupts the training at once\n"
        )

        # A job a shell starts in the background ignores SIGINT: it still does; SIGTERM still stops.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with stop_on_signals(1) as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
            assert stop.reason is None
            signal.raise_signal(signal.SIGTERM)
            assert stop.reason == "SIGTERM" and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            assert stop.failure(RuntimeError("boom")) == "RuntimeError: boom"
            assert stop.failure(KeyboardInterrupt()) == (
                "KeyboardInterrupt: interrupted by SIGINT after SIGTERM before the step boundary"
            )
        assert capfd.readouterr().err == (
            "d9d: SIGTERM: this rank stops when rank 0 does, whose signal stops the run; "
            "a second SIGTERM ends the process at once\n"
        )
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c(proc: subprocess.Popen[str]) -> None:
    """SIGINT to the launch's process group: what a terminal's Ctrl-C sends the command it runs."""
    os.killpg(proc.pid, signal.SIGINT)


@pytest.mark.timeout(240)
def test_ctrl_c_stops_a_process_run_at_a_step_boundary_which_it_commits(tmp_path: Path) -> None:
    proc, run = _launch(tmp_path)
    try:
        _wait_for_step(proc, run, 3)
        _ctrl_c(proc)
        assert proc.wait(timeout=60) == 0
    finally:
        _kill(proc)
    log = proc.communicate()[0]
    assert "d9d: SIGINT: stopping at the next step boundary" in log and "Traceback" not in log, log[-3000:]
    record = find_record("proc", run_dir=run)
    assert record is not None
    state = state_from_files(record)
    assert state.state == "stopped" and state.step is not None and state.step >= 3, state
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["status"], summary["stop_reason"]) == ("stopped", "SIGINT")
    assert (run / "checkpoints" / "latest").read_text() == f"step-{state.step:08d}"


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_rank_of_a_torchrun_launch_at_one_step(tmp_path: Path) -> None:
    """The terminal's SIGINT reaches torchrun's agent (its workers run in sessions of their own), which sends
    SIGINT to every worker once: both stop at one step, which they commit, and exit with 0. The agent then
    ends with its SignalException (exit 1): torchrun's, whatever its workers did."""
    proc, run = _launch(tmp_path, "torchrun", mesh={"data_parallel_replicate": 2})
    try:
        _wait_for_step(proc, run, 3)
        _ctrl_c(proc)
        assert proc.wait(timeout=60) == 1
    finally:
        _kill(proc)
    log = proc.communicate()[0]
    assert "d9d: SIGINT: stopping at the next step boundary" in log, log[-3000:]
    assert "d9d: SIGINT: this rank stops when rank 0 does" in log, log[-3000:]
    assert "SignalException: Process" in log and "Unable to shutdown process" not in log, log[-3000:]
    record = find_record("proc", run_dir=run)
    assert record is not None
    state = state_from_files(record)
    assert state.state == "stopped" and state.step is not None and state.step >= 3, (state, log[-3000:])
    summary = json.loads((run / "run_summary.json").read_text())
    assert (summary["status"], summary["stop_reason"]) == ("stopped", "SIGINT")
    assert (run / "checkpoints" / "latest").read_text() == f"step-{state.step:08d}"


@pytest.mark.timeout(240)
def test_a_second_ctrl_c_interrupts_a_step_that_does_not_reach_its_boundary(tmp_path: Path) -> None:
    """Step 4 never ends (its data sleeps): the first Ctrl-C's stop waits for its boundary, the second raises
    KeyboardInterrupt at once; the launch records `failed` naming the interruption, and step 2's commit
    stays the newest, whole (a relaunch resumes from it)."""
    stalled, log = tmp_path / "stalled", tmp_path / "launch.log"
    data = {
        "provider": "tests.engine_fixtures:StallingData",
        "options": {"stall_at": 4, "marker": str(stalled)},
    }
    proc, run = _launch(tmp_path, log=log, data=data, checkpointing={"period": 2})
    try:
        deadline = time.monotonic() + 120
        while not stalled.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert (run / "checkpoints" / "latest").read_text() == "step-00000002"
        _ctrl_c(proc)
        while "d9d: SIGINT: stopping" not in log.read_text():  # the first has reached the launch
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)
        assert proc.poll() is None  # waiting for a boundary that does not come
        sent = time.monotonic()
        _ctrl_c(proc)
        assert proc.wait(timeout=30) == -signal.SIGINT  # Python's exit on an unhandled KeyboardInterrupt
        assert time.monotonic() - sent < 10
    finally:
        _kill(proc)
    out = log.read_text()
    assert "KeyboardInterrupt" in out, out[-3000:]
    record = find_record("proc", run_dir=run)
    assert record is not None and state_from_files(record).state == "failed"
    summary = json.loads((run / "run_summary.json").read_text())
    assert summary["status"] == "failed" and summary["stop_reason"] is None
    assert summary["error"] == "KeyboardInterrupt: interrupted by a second SIGINT before the step boundary"
    assert (run / "checkpoints" / "latest").read_text() == "step-00000002"
    decision = check_resume(load_config(tmp_path / "job.yaml"))
    assert (decision.action, decision.step) == ("resume", 2), decision


def _sleeper(ignore_sigterm: bool = False) -> subprocess.Popen[str]:
    code = "import signal, sys, time\n"
    if ignore_sigterm:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('ready', flush=True)\ntime.sleep(120)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_d9d_stop_refuses_a_process_run_of_another_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    sleeper = _sleeper()
    try:
        # Its pid is a live process here: only the host tells it is not the run's.
        _record(runs / "elsewhere", f"gpu-node-7:{sleeper.pid}", time.time())
        assert main(["stop", "elsewhere", "--runs-root", str(runs)]) == 1
        err = capsys.readouterr().err
        assert err == (
            f"d9d stop: run 'elsewhere' runs as process {sleeper.pid} on host gpu-node-7, not on this one "
            f"({socket.gethostname()}): run d9d stop there (or send that process SIGTERM)\n"
        )
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_d9d_stop_of_a_process_run_whose_process_is_gone_or_whose_pid_was_reused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    host = socket.gethostname()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    _record(runs / "gone", f"{host}:{int(gone.stdout)}", time.time())
    assert main(["stop", "gone", "--runs-root", str(runs)]) == 1
    assert capsys.readouterr().err == "d9d stop: run 'gone' is not running (died; script launch)\n"

    sleeper = _sleeper()
    try:
        # The pid is a live process that started after the run was recorded: not the run's, never signalled.
        _record(runs / "reused", f"{host}:{sleeper.pid}", time.time() - 3600)
        assert main(["stop", "reused", "--runs-root", str(runs)]) == 1
        assert capsys.readouterr().err == "d9d stop: run 'reused' is not running (died; script launch)\n"
        time.sleep(0.2)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_d9d_stop_kills_a_process_that_does_not_stop_within_the_timeout_and_now_kills_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = tmp_path / "runs"
    host = socket.gethostname()
    deaf = _sleeper(ignore_sigterm=True)
    _record(runs / "deaf", f"{host}:{deaf.pid}", time.time())
    started = time.monotonic()
    assert main(["stop", "deaf", "--runs-root", str(runs), "--timeout", "1"]) == 0
    assert deaf.wait(timeout=10) == -signal.SIGKILL
    assert 1.0 <= time.monotonic() - started < 10
    out = capsys.readouterr().out
    assert "not ended within 1s: killed it (SIGKILL)" in out and out.endswith("run deaf: died\n"), out

    sleeper = _sleeper()
    _record(runs / "now", f"{host}:{sleeper.pid}", time.time())
    assert main(["stop", "now", "--runs-root", str(runs), "--now"]) == 0
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert f"killed the script's rank 0 (pid {sleeper.pid}) (SIGKILL)" in capsys.readouterr().out
