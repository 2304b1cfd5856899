"""One PNG of a run's curves: loss (train and eval), learning rate, gradient norm and tokens per second,
with the run's resumes and restarts marked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from d9d.core.files import atomic_write_bytes
from d9d.tracking.history import RESTART, RESUMED_FROM

PLOT_FILE = "plots/training.png"
# (panel title, series drawn in it); the first series of a panel is the main one.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("train/loss", "eval/loss")),
    ("learning rate", ("train/lr",)),
    ("gradient norm", ("train/grad_norm",)),
    ("tokens / s", ("train/tokens_per_s",)),
)


RESTART_STYLE: dict[str, Any] = {"color": "tab:red", "linestyle": ":", "linewidth": 1.2}
RESUME_STYLE: dict[str, Any] = {"color": "tab:green", "linestyle": "--", "linewidth": 1.2}


@dataclass(frozen=True)
class Marker:
    """An attempt that started from a commit: the first step it trained, the commit's step, and whether it
    was a restart of a launch (after a failure or for a resize) or a launch resuming the run."""

    step: int
    from_step: int
    restart: bool

    @property
    def label(self) -> str:
        return f"{'restart' if self.restart else 'resume'} from step {self.from_step}"


def markers(history: Mapping[str, Mapping[int, float]]) -> list[Marker]:
    """The resumes and restarts a history recorded (d9d.tracking.history.RESUMED_FROM), in step order."""
    resumed = history.get(RESUMED_FROM, {})
    restart = history.get(RESTART, {})
    return [Marker(step, int(resumed[step]), restart.get(step, 0.0) > 0) for step in sorted(resumed)]


def figure_of(history: Mapping[str, Mapping[int, float]], title: str | None = None) -> Any:
    """The 2×2 panel figure (matplotlib `Figure` on the Agg canvas); every panel marks the resumes (green,
    dashed) and restarts (red, dotted) at the first step they trained."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 6.4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas: no display, no global pyplot state
    marks = markers(history)
    for index, (panel, names) in enumerate(PANELS):
        axes = figure.add_subplot(2, 2, index + 1)
        drawn = False
        for name in names:
            series = history.get(name)
            if not series:
                continue
            steps = sorted(series)
            axes.plot(
                steps,
                [series[s] for s in steps],
                label=name,
                linewidth=1.3,
                marker="." if len(steps) < 50 else None,
            )
            drawn = True
        labelled: set[bool] = set()
        for mark in marks:
            style = RESTART_STYLE if mark.restart else RESUME_STYLE
            label = None if mark.restart in labelled else ("restart" if mark.restart else "resume")
            labelled.add(mark.restart)
            axes.axvline(mark.step, label=label, **style)
        if drawn:
            if len(names) > 1 or marks:
                axes.legend(fontsize=8)
        else:
            axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes, color="grey")
        axes.set_title(panel)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    return figure


def plot_history(history: Mapping[str, Mapping[int, float]], path: Path, title: str | None = None) -> Path:
    """Write the 2×2 panel PNG to `path` (atomically); a panel without data says so."""
    import io

    buffer = io.BytesIO()
    figure_of(history, title).savefig(buffer, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())
    return path
