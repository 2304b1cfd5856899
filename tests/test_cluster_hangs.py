"""Hang attribution (issue 29, deliverable 6): when an attempt is declared hung, every rank's Python stacks
are collected before the teardown, and the failure says which rank is behind and where — on the console,
in run_summary.json and in `<run dir>/hang-attempt<N>.txt`."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from d9d.cluster import TrainingJob, build_job
from d9d.cluster.control.hang import attribute, position, render, training_thread
from d9d.cluster.follow import follow
from d9d.core.flight_recorder import Collective, Group, Snapshot
from tests.cluster_fixtures import toy_job

_RUN = '  File "/x/d9d/cluster/rank.py", line 300 in _run\n'
_SLEEPING = (
    "Thread 0x00007f01 (most recent call first):\n"
    '  File "/x/d9d/cluster/reporter.py", line 120 in _carry\n\n'
    "Current thread 0x00007f02 (most recent call first):\n"
    '  File "/x/tests/cluster_fixtures.py", line 276 in train_step\n'
    '  File "/x/tests/cluster_fixtures.py", line 320 in run\n' + _RUN
)


def _waiting(collective: str, line: int, func: str) -> str:
    return (
        "Current thread 0x00007f02 (most recent call first):\n"
        f'  File "/v/torch/distributed/distributed_c10d.py", line 2800 in {collective}\n'
        '  File "/v/torch/distributed/c10d_logger.py", line 81 in wrapper\n'
        f'  File "/x/tests/cluster_fixtures.py", line {line} in {func}\n' + _RUN
    )


def test_the_rank_outside_the_collective_or_at_another_one_is_named() -> None:
    frames = training_thread(_SLEEPING)
    assert frames is not None and frames[0].func == "train_step"  # not the courier thread
    assert (
        position(frames).describe()
        == "not in a collective, at /x/tests/cluster_fixtures.py:276 in train_step"
    )

    sleeping = attribute({0: _waiting("all_reduce", 280, "train_step"), 1: _SLEEPING}, 2)
    assert sleeping.behind == (1,)
    assert sleeping.summary == (
        "rank 1 is behind, not in a collective, at /x/tests/cluster_fixtures.py:276 in train_step; ranks [0] "
        "wait for it in all_reduce called at /x/tests/cluster_fixtures.py:280 in train_step"
    )
    skipped = attribute(
        {r: _waiting("all_reduce", 280, "train_step") for r in (0, 2)}
        | {1: _waiting("broadcast_object_list", 250, "_commands")},
        3,
    )
    assert skipped.behind == (1,) and "ranks wait in different collectives" in skipped.summary
    assert "rank 1 in broadcast_object_list called at /x/tests/cluster_fixtures.py:250" in skipped.summary
    frozen = attribute({0: _waiting("all_reduce", 280, "train_step"), 1: None}, 2)
    assert frozen.behind == (1,) and "rank 1 gave no stacks (frozen" in frozen.summary
    # A dump cut short before the training thread (seen under load): its courier thread, waiting on an
    # event, is not taken for the rank's position.
    cut = (
        _SLEEPING.split("Current thread")[0]
        + 'Thread 0x00007f03 (most recent call first):\n  File "<frozen os>"'
    )
    assert training_thread(cut) is None
    partial = attribute({0: _waiting("all_reduce", 280, "train_step"), 1: cut}, 2)
    assert partial.behind == (1,) and "not in a collective" not in partial.summary
    assert "rank 1 gave a stack dump without its training thread (cut short)" in partial.summary
    stuck = attribute({r: _waiting("all_reduce", 280, "train_step") for r in (0, 1)}, 2)
    assert stuck.behind == () and stuck.summary.startswith("every rank waits in all_reduce")


def _blocked_in_item(line: int) -> str:
    """A rank blocked in a CUDA sync after enqueuing its NCCL collectives: no torch.distributed frame."""
    return (
        "Current thread 0x00007f02 (most recent call first):\n"
        f'  File "/x/d9d/engine/step.py", line {line} in global_loss\n' + _RUN
    )


def test_when_no_stack_singles_a_rank_out_the_lagging_sequence_number_does() -> None:
    def snap(ops: list[tuple[int, str]]) -> Snapshot:
        return Snapshot(
            tuple(
                Collective("nccl", "0", s, False, "all_reduce", st, ((9,),), ("Float",), s) for s, st in ops
            ),
            {"0": Group("default_pg", (0, 1))},
        )

    stacks: dict[int, str | None] = {0: _blocked_in_item(120), 1: _SLEEPING}
    collectives = {0: snap([(11, "completed"), (12, "scheduled")]), 1: snap([(11, "completed")])}

    without = attribute(stacks, 2)
    assert without.behind == (0, 1)  # both outside a collective: the stacks cannot tell
    report = attribute(stacks, 2, collectives=collectives)
    assert report.behind == (1,)
    assert report.summary.endswith(
        "flight recorder: group 0 (default_pg, nccl): rank 1 is behind, its last collective is #11 "
        "all_reduce (completed); rank 0 issued up to #12 and waits in #12 all_reduce Float[9]"
    )
    assert report.collectives is not None and report.collectives.ranks[1] == (
        "last completed #11 all_reduce Float[9] in group 0 (default_pg, nccl); nothing pending"
    )
    text = render(report, stacks, "hang: no step completed for 3.0s", collectives)
    assert (
        "==== rank 0: last collectives, oldest first ====\n"
        "  nccl group 0: #11 all_reduce Float[9] completed\n"
        "  nccl group 0: #12 all_reduce Float[9] scheduled\n"
    ) in text


@pytest.mark.ray
@pytest.mark.timeout(180)
@pytest.mark.usefixtures("_ray")
@pytest.mark.parametrize("kind", ["hang", "skip_collective"])
def test_a_hung_rank_is_named_with_where_it_is_before_the_teardown(tmp_path: Path, kind: str) -> None:
    """`hang`: rank 1 sleeps inside step 3 while rank 0 waits in the gradient all-reduce. `skip_collective`:
    rank 1 skips that all-reduce and goes on to the next step's command broadcast, where it waits."""
    fault = {"kind": kind, "step": 3, "rank": 1}
    job = toy_job(
        kind,
        tmp_path,
        steps=8,
        model={"options": {"faults": [fault]}},
        timeouts={"init_s": 60, "step_s": 3},
        cluster={"max_failures": 0},
    )
    console = io.StringIO()
    summary = follow(TrainingJob(build_job(job)).start(), out=console, interactive=False)

    assert summary.status == "failed" and len(summary.failures) == 1
    failure = summary.failures[0]
    hang_file = tmp_path / "hang-attempt0.txt"
    assert failure.startswith("hang: no step completed") and f"(all stacks: {hang_file})" in failure
    if kind == "hang":
        assert "rank 1 is behind, not in a collective, at " in failure and "cluster_fixtures.py" in failure
        assert "in train_step; ranks [0] wait for it in all_reduce called at " in failure
        # The flight recorders: rank 1 never issued the all-reduce rank 0 waits in.
        lag = re.search(
            r"flight recorder: group 0 \(default_pg, gloo\): rank 1 is behind, its last collective is "
            r"#(\d+) broadcast \(completed\); rank 0 issued up to #(\d+) and waits in #\2 all_reduce Float",
            failure,
        )
        assert lag is not None and int(lag[2]) == int(lag[1]) + 1, failure
    else:
        assert "ranks wait in different collectives (a rank skipped or added one)" in failure
        assert "rank 0 in all_reduce called at" in failure and "in train_step" in failure
        assert "rank 1 in broadcast_object_list called at" in failure and "in _commands" in failure
        # The same number on both, a different op: rank 1's numbers are one ahead of where they belong.
        lag = re.search(
            r"flight recorder: group 0 \(default_pg, gloo\): the ranks disagree on collective #(\d+) "
            r"\(rank 0 all_reduce Float\[\d+\] \(pending\); rank 1 broadcast Long\[1\] \(pending\)\)",
            failure,
        )
        assert lag is not None, failure
    assert summary.error is not None and failure in summary.error  # run_summary.json
    assert f"attempt failed: {failure}" in console.getvalue()  # the console
    text = hang_file.read_text()  # the file: the attribution, then every rank's whole dump
    assert "==== rank 0 ====" in text and "==== rank 1 ====" in text and "d9d/cluster/reporter.py" in text
    # ... each rank's last completed and pending collective, and its recorded ones.
    assert "collectives (flight recorder):\nrank 0: last completed #" in text
    assert f"rank 0: last completed #{int(lag[1]) - (kind == 'skip_collective')} broadcast" in text
    assert (
        "==== rank 1: last collectives, oldest first ====\n  gloo group 0: #1 broadcast Long[1] completed"
        in text
    )
