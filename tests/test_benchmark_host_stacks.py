"""`benchmarks/throughput/host_stacks.py`: py-spy's raw stacks summarized per process under the step's frame,
against counts made by hand for a few synthetic stacks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench_fixtures import import_benchmark


@pytest.fixture(scope="module")
def host_stacks() -> Iterator[ModuleType]:
    yield from import_benchmark("throughput.host_stacks")


LAUNCHER = 'process 10:"torchrun"'
RANK0, RANK1 = 'process 11:"python -m d9d.engine.launch"', 'process 12:"python -m d9d.engine.launch"'
STEP = "Trainer._run_step (d9d/engine/trainer.py:{})"

LINES = [
    # rank 0: 3 samples in forward (two lines of one function), 1 at the end-of-step read, 5 compiling
    f"{LAUNCHER};{RANK0};main (launch.py:1);{STEP.format(219)};forward (step.py:70);mm (ops.py:5) 2",
    f"{LAUNCHER};{RANK0};main (launch.py:1);{STEP.format(219)};forward (step.py:71);mm (ops.py:5) 1",
    f"{LAUNCHER};{RANK0};main (launch.py:1);{STEP.format(230)};wait (host_copy.py:9) 1",
    f"{LAUNCHER};{RANK0};main (launch.py:1);{STEP.format(219)};_compile (torch/_dynamo/convert_frame.py:3) 5",
    # and 6 in a Triton kernel's first-call compilation
    f"{LAUNCHER};{RANK0};{STEP.format(219)};run (triton/jit.py:1);compile (triton/compiler/compiler.py:2) 6",
    # rank 0 outside the step (start-up) and on autograd's thread: not the step's thread
    f"{LAUNCHER};{RANK0};main (launch.py:1);import (x.py:1) 7",
    f"{LAUNCHER};{RANK0};backward (function.py:3) 4",
    # rank 1: a recursive frame is counted once per stack
    f"{LAUNCHER};{RANK1};{STEP.format(219)};f (a.py:1);f (a.py:2) 3",
]


def test_counts_the_step_thread_per_process_without_compilation(host_stacks: ModuleType) -> None:
    found = host_stacks.step_samples(LINES, "Trainer._run_step")
    assert set(found) == {"process 11", "process 12"}
    rank0 = found["process 11"]
    assert rank0.total == 4
    assert rank0.inclusive["Trainer._run_step (d9d/engine/trainer.py)"] == 4
    assert rank0.inclusive["forward (step.py)"] == 3
    assert rank0.leaf == {"mm (ops.py)": 3, "wait (host_copy.py)": 1}
    assert "main (launch.py)" not in rank0.inclusive  # above the root
    rank1 = found["process 12"]
    assert (rank1.total, rank1.inclusive["f (a.py)"], rank1.leaf["f (a.py)"]) == (3, 3, 3)


THREAD_LINES = [
    # rank 0: the step's thread holds the GIL 5 samples in the step and 2 outside, the courier 3
    f"{RANK0};thread (11): MainThread;main (launch.py:1);{STEP.format(219)};forward (step.py:70) 5",
    f"{RANK0};thread (11): MainThread;main (launch.py:1);log (x.py:3) 2",
    f"{RANK0};thread (13): d9d-courier;_carry (reporter.py:1);remote (actor.py:9) 2",
    f"{RANK0};thread (13): d9d-courier;_carry (reporter.py:1);pickle (ser.py:2) 1",
    # a thread without a Python name, with no frames: counted, no leaf
    f"{RANK0};thread (14) 4",
    # start-up (compilation, imports): left out
    f"{RANK0};thread (11): MainThread;{STEP.format(219)};_compile (torch/_dynamo/convert_frame.py:3) 9",
    f"{RANK0};thread (13): d9d-courier;_find (<frozen importlib._bootstrap>:1) 9",
    # a process that never ran the step (Ray's dashboard): left out
    'process 30:"dashboard";thread (30): MainThread;serve (d.py:1) 50',
]


def test_counts_each_threads_gil_samples_in_processes_that_run_the_step(host_stacks: ModuleType) -> None:
    found = host_stacks.thread_samples(THREAD_LINES, "Trainer._run_step")
    assert set(found) == {"process 11"}
    by_thread = found["process 11"]
    assert set(by_thread) == {"MainThread (11)", "d9d-courier (13)", "(14)"}
    main = by_thread["MainThread (11)"]
    assert (main.total, main.in_step) == (7, 5)
    assert main.leaf == {"forward (step.py)": 5, "log (x.py)": 2}
    courier = by_thread["d9d-courier (13)"]
    assert (courier.total, courier.in_step) == (3, 0)
    assert courier.leaf == {"remote (actor.py)": 2, "pickle (ser.py)": 1}
    assert (by_thread["(14)"].total, by_thread["(14)"].leaf) == (4, {})


def test_a_root_frame_no_sample_runs_is_an_error_naming_the_frames_meant(
    host_stacks: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """py-spy prints methods with their class (`Trainer._run_step`): a bare `_run_step` matches nothing, and
    the tool says so with the frames that contain it instead of printing an empty table."""
    profile = tmp_path / "raw.txt"
    profile.write_text("\n".join(LINES) + "\n")
    monkeypatch.setattr("sys.argv", ["host_stacks.py", str(profile), "_run_step"])
    with pytest.raises(SystemExit, match=r"frames containing it: \['Trainer._run_step'\]"):
        host_stacks.main()
