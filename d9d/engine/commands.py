"""Control commands at a step boundary: pause, resume, update, checkpoint now, stop — one loop.

Rank 0 asks the reporter for pending commands and broadcasts them, so every rank applies the same commands
at the same step. While paused, the ranks keep polling at the boundary (still applying updates and
checkpoint requests) until a resume or a stop arrives.

Sleep (`d9d.engine.offload`) is a deeper pause: SLEEP pauses the ranks (`paused()` is reported first) and
then moves the training state to host memory; WAKE brings it back and leaves the ranks paused; RESUME
wakes and runs; STOP wakes (the run's end saves and exports) and stops. Between SLEEP and WAKE/RESUME,
the last one in a batch wins, as for PAUSE and RESUME. A checkpoint requested while asleep is saved at the
wake: the state to save is on the host until then. States, as seen from outside: running → (PAUSE) paused
→ (SLEEP) asleep → (WAKE) paused → (RESUME) running; SLEEP while running goes straight to asleep, RESUME
while asleep straight to running.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from d9d.core.context import DistributedContext
from d9d.engine.runtime import Command, CommandKind, RunReporter

POLL_S = 0.2


class CommandTarget(Protocol):
    """What commands act on (the training loop)."""

    def request_checkpoint(self) -> None:
        """Save at this boundary when a step has run since the start, else after the next step."""
        ...

    def save_requested_checkpoint(self) -> None:
        """Save now if a checkpoint is requested and a step has run."""
        ...

    def update(self, values: Mapping[str, Any]) -> None:
        """Change live-safe settings (e.g. the learning rate)."""
        ...

    def paused(self) -> None: ...

    def resumed(self) -> None: ...

    def sleep(self) -> None:
        """Move the training state to host memory (the ranks are paused)."""
        ...

    def wake(self) -> None:
        """Bring the training state back to the device."""
        ...


class Decision(enum.Enum):
    RUN = "run"
    PAUSE = "pause"
    STOP = "stop"


def broadcast_commands(reporter: RunReporter, ctx: DistributedContext, step: int) -> list[Command]:
    """The pending commands, read on rank 0 and broadcast to every rank."""
    commands = list(reporter.commands(step)) if ctx.is_main_process else []
    if ctx.is_distributed:
        box: list[Any] = [commands]
        dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
        commands = box[0]
    return commands


class CommandHandler:
    def __init__(
        self,
        receive: Callable[[], Sequence[Command]],
        target: CommandTarget,
        *,
        poll_s: float = POLL_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.receive = receive
        self.target = target
        self.poll_s = poll_s
        self.sleep = sleep
        self.asleep = False  # the training state is in host memory
        self._sleep_wanted = False  # by the last batch; acted on once the ranks are paused

    def at_boundary(self) -> bool:
        """Apply pending commands; wait while paused. True: run the next step; False: stop training."""
        paused = False
        while True:
            decision = self.apply(self.receive(), paused)
            if decision is Decision.STOP:
                return False
            if decision is Decision.RUN:
                if paused:
                    self.target.resumed()
                return True
            if not paused:
                paused = True
                self.target.paused()
            if self._sleep_wanted and not self.asleep:
                self.target.sleep()
                self.asleep = True
            self.sleep(self.poll_s)

    def apply(self, commands: Sequence[Command], paused: bool) -> Decision:
        """Apply one batch in order. A pause in the batch wins over an earlier resume (and vice versa);
        while paused, only a resume or a stop ends the pause. Sleeping itself waits for `at_boundary` to
        report the pause; waking happens here, before a requested checkpoint is saved."""
        running = not paused
        asleep = self.asleep
        for command in commands:
            match command.kind:
                case CommandKind.STOP:
                    self._wake()
                    return Decision.STOP
                case CommandKind.CHECKPOINT_NOW:
                    self.target.request_checkpoint()
                case CommandKind.UPDATE:
                    self.target.update(command.values)
                case CommandKind.PAUSE if not paused:
                    running = False
                case CommandKind.PAUSE:
                    pass  # already paused: a resume in the same batch still ends the pause
                case CommandKind.RESUME:
                    running, asleep = True, False
                case CommandKind.SLEEP:
                    running, asleep = False, True
                case CommandKind.WAKE:
                    asleep = False
        self._sleep_wanted = asleep
        if not asleep:
            self._wake()
        if not self.asleep:  # asleep, a requested checkpoint waits for the wake
            self.target.save_requested_checkpoint()
        return Decision.RUN if running else Decision.PAUSE

    def _wake(self) -> None:
        if self.asleep:
            self.target.wake()
            self.asleep = False
