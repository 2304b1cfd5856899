"""The command handler at a step boundary, without processes: scripted command batches, a recording target."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from d9d.engine.commands import CommandHandler
from d9d.engine.runtime import Command, CommandKind

PAUSE = Command(CommandKind.PAUSE)
RESUME = Command(CommandKind.RESUME)
STOP = Command(CommandKind.STOP)
CHECKPOINT = Command(CommandKind.CHECKPOINT_NOW)
SLEEP = Command(CommandKind.SLEEP)
WAKE = Command(CommandKind.WAKE)


def update(lr: float) -> Command:
    return Command(CommandKind.UPDATE, {"lr": lr})


class Recorder:
    """A training loop stand-in: records what the handler asked, in order; `step` is the steps run."""

    def __init__(self, step: int = 3) -> None:
        self.step = step
        self.calls: list[str] = []
        self.requested = False

    def request_checkpoint(self) -> None:
        self.requested = True

    def save_requested_checkpoint(self) -> None:
        if self.requested and self.step > 0:
            self.calls.append(f"save@{self.step}")
            self.requested = False

    def update(self, values: Mapping[str, Any]) -> None:
        self.calls.append(f"update {dict(values)}")

    def paused(self) -> None:
        self.calls.append("paused")

    def resumed(self) -> None:
        self.calls.append("resumed")

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake(self) -> None:
        self.calls.append("wake")


def run(
    batches: Sequence[Sequence[Command]], target: Recorder, handler: list[CommandHandler] | None = None
) -> tuple[bool, int]:
    """Handle one boundary; return (run the next step?, how many batches were read)."""
    queue = list(batches)
    reads = 0
    sleeps: list[float] = []

    def receive() -> Sequence[Command]:
        nonlocal reads
        reads += 1
        assert queue, "the handler polled after the script ended: it should have returned"
        return queue.pop(0)

    made = CommandHandler(receive, target, poll_s=0.5, sleep=sleeps.append)
    if handler is not None:
        handler.append(made)
    go_on = made.at_boundary()
    assert sleeps == [0.5] * (reads - 1)  # it waits between polls, never before the first
    return go_on, reads


def test_no_commands_runs_the_next_step() -> None:
    target = Recorder()
    assert run([[]], target) == (True, 1)
    assert target.calls == []


def test_updates_and_checkpoints_apply_at_the_boundary() -> None:
    target = Recorder()
    assert run([[update(0.1), CHECKPOINT, update(0.2)]], target) == (True, 1)
    assert target.calls == ["update {'lr': 0.1}", "update {'lr': 0.2}", "save@3"]


def test_checkpoint_before_the_first_step_waits_for_it() -> None:
    target = Recorder(step=0)
    assert run([[CHECKPOINT]], target) == (True, 1)
    assert target.calls == []
    assert target.requested  # the loop saves after its next step


def test_stop_ends_training_and_ignores_what_follows() -> None:
    target = Recorder()
    assert run([[update(0.1), STOP, update(0.2)]], target) == (False, 1)
    assert target.calls == ["update {'lr': 0.1}"]


def test_pause_polls_until_resume_applying_commands_meanwhile() -> None:
    target = Recorder()
    batches = [[PAUSE], [], [update(0.3)], [CHECKPOINT, PAUSE], [RESUME]]
    assert run(batches, target) == (True, 5)
    assert target.calls == ["paused", "update {'lr': 0.3}", "save@3", "resumed"]


def test_update_delivered_with_the_resume_is_applied_before_running() -> None:
    target = Recorder()
    assert run([[PAUSE], [update(0.5), RESUME]], target) == (True, 2)
    assert target.calls == ["paused", "update {'lr': 0.5}", "resumed"]


def test_stop_while_paused_ends_training() -> None:
    target = Recorder()
    assert run([[PAUSE], [], [STOP]], target) == (False, 3)
    assert target.calls == ["paused"]


def test_last_of_pause_and_resume_in_one_batch_wins() -> None:
    target = Recorder()
    assert run([[PAUSE, RESUME]], target) == (True, 1)
    assert target.calls == []
    target = Recorder()
    assert run([[RESUME, PAUSE], [RESUME]], target) == (True, 2)
    assert target.calls == ["paused", "resumed"]
    # While paused, a resume ends the pause even when a pause follows it in the same batch.
    target = Recorder()
    assert run([[PAUSE], [RESUME, PAUSE]], target) == (True, 2)
    assert target.calls == ["paused", "resumed"]


def test_sleep_pauses_first_then_wake_stays_paused_until_resume() -> None:
    target = Recorder()
    made: list[CommandHandler] = []
    assert run([[SLEEP], [], [WAKE], [], [RESUME]], target, made) == (True, 5)
    assert target.calls == ["paused", "sleep", "wake", "resumed"]
    assert not made[0].asleep


def test_resume_and_stop_wake_a_sleeping_run_first() -> None:
    target = Recorder()
    assert run([[PAUSE], [SLEEP], [update(0.1), RESUME]], target) == (True, 3)
    assert target.calls == ["paused", "sleep", "update {'lr': 0.1}", "wake", "resumed"]
    target = Recorder()
    assert run([[SLEEP], [STOP]], target) == (False, 2)
    assert target.calls == ["paused", "sleep", "wake"]  # the run's end saves from the device


def test_checkpoint_requested_while_asleep_is_saved_at_the_wake() -> None:
    target = Recorder()
    assert run([[SLEEP], [CHECKPOINT], [], [WAKE], [RESUME]], target) == (True, 5)
    assert target.calls == ["paused", "sleep", "wake", "save@3", "resumed"]
    # Requested with the sleep: saved first, then the state goes to the host.
    target = Recorder()
    assert run([[SLEEP, CHECKPOINT], [RESUME]], target) == (True, 2)
    assert target.calls == ["save@3", "paused", "sleep", "wake", "resumed"]


def test_last_of_sleep_and_wake_in_one_batch_wins() -> None:
    target = Recorder()
    assert run([[SLEEP, WAKE], [RESUME]], target) == (True, 2)
    assert target.calls == ["paused", "resumed"]  # paused, never asleep
    target = Recorder()
    assert run([[SLEEP, RESUME]], target) == (True, 1)
    assert target.calls == []
    target = Recorder()
    assert run([[PAUSE], [RESUME, SLEEP], [SLEEP], [WAKE, SLEEP], [RESUME]], target) == (True, 5)
    assert target.calls == ["paused", "sleep", "wake", "resumed"]  # one sleep, one wake
    target = Recorder()
    assert run([[WAKE]], target) == (True, 1)  # waking a run that is not asleep does nothing
    assert target.calls == []
