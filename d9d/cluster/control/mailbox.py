"""What clients asked the run to do: the commands rank 0 polls, and the requests the controller obeys."""

from __future__ import annotations

from dataclasses import dataclass, field

from d9d.engine.runtime import Command, CommandKind


@dataclass
class CommandMailbox:
    commands: list[tuple[int, Command]] = field(default_factory=list)
    seq: int = 0  # of the last command posted
    delivered: int = 0  # the highest seq rank 0 has fetched; a new attempt's rank 0 starts after it
    paused: bool = False
    asleep: bool = False  # asked to sleep (implies paused); a WAKE leaves it paused, a RESUME runs
    stop: bool = False  # end at the next step boundary (or before the next attempt)
    kill: bool = False  # end now: ranks are killed, nothing is saved
    _resize_to: int | None = None

    def post(self, command: Command) -> None:
        match command.kind:
            case CommandKind.PAUSE:
                self.paused = True
            case CommandKind.SLEEP:
                self.paused = self.asleep = True
            case CommandKind.WAKE:
                self.asleep = False
            case CommandKind.RESUME:
                self.paused = self.asleep = False
            case CommandKind.STOP:
                self.stop = True
            case CommandKind.CHECKPOINT_NOW | CommandKind.UPDATE:
                pass  # only the ranks act on these
        self.seq += 1
        self.commands.append((self.seq, command))

    def request_kill(self) -> None:
        self.stop = self.kill = True

    def request_resize(self, workers: int) -> None:
        self._resize_to = workers

    def take_resize(self) -> int | None:
        workers, self._resize_to = self._resize_to, None
        return workers

    def since(self, seq: int) -> tuple[int, list[Command]]:
        """Commands posted after `seq` (marked delivered) and the seq to poll from next."""
        self.delivered = max(self.delivered, self.seq)
        return self.seq, [c for s, c in self.commands if s > seq]
