"""Step progress on the main rank: a rich progress bar when interactive, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Literal

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from d9d.core.logging import RankLoggerAdapter


class StepProgress:
    def __init__(
        self,
        total_steps: int,
        start_step: int,
        logger: RankLoggerAdapter,
        enabled: bool,
        mode: Literal["auto", "on", "off"] = "auto",
        log_period: int = 1,
    ) -> None:
        self.logger = logger
        self.log_period = log_period
        self.total_steps = total_steps
        self.enabled = enabled
        interactive = sys.stderr.isatty() if mode == "auto" else mode == "on"
        self._bar: Progress | None = None
        self._task = None
        self._last = time.monotonic()
        if enabled and interactive:
            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._bar.start()
            self._task = self._bar.add_task("train", total=total_steps, completed=start_step, info="")

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float | None) -> None:
        if not self.enabled:
            return
        tps = f" tok/s {tokens_per_s:,.0f}" if tokens_per_s is not None else ""
        info = f"loss {loss:.4f} lr {lr:.3g}{tps}"
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=step, info=info)
        elif step % self.log_period == 0 or step == self.total_steps:
            self.logger.info("step %d/%d %s", step, self.total_steps, info)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
