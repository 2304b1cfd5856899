"""Control commands at a step boundary: pause, resume, update, checkpoint now, stop — one loop.

Rank 0 asks the reporter for pending commands and broadcasts them, so every rank applies the same commands
at the same step. While paused, the ranks keep polling at the boundary (still applying updates and
checkpoint requests) until a resume or a stop arrives.
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
            self.sleep(self.poll_s)

    def apply(self, commands: Sequence[Command], paused: bool) -> Decision:
        """Apply one batch in order. A pause in the batch wins over an earlier resume (and vice versa);
        while paused, only a resume or a stop ends the pause."""
        running = not paused
        for command in commands:
            match command.kind:
                case CommandKind.STOP:
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
                    running = True
        self.target.save_requested_checkpoint()
        return Decision.RUN if running else Decision.PAUSE
