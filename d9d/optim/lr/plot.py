"""Drawing a schedule to a PNG, without touching pyplot's global state."""

from __future__ import annotations

from pathlib import Path

from d9d.optim.lr.schedule import PiecewiseSchedule

_MAX_POINTS = 4000


def plot_schedule(
    schedule: PiecewiseSchedule,
    path: str | Path,
    *,
    base_lr: float | None = None,
    title: str | None = None,
) -> None:
    """Write the multiplier (or LR, given `base_lr`) per step, with phase boundaries dotted."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    end = max(schedule.end, 1)
    stride = max(1, end // _MAX_POINTS)
    steps = sorted({*range(0, end + 1, stride), end, *(s.start for s in schedule.segments)})
    scale = 1.0 if base_lr is None else base_lr
    values = [schedule.multiplier(step) * scale for step in steps]

    figure = Figure(figsize=(6.4, 3.2), dpi=100, layout="tight")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.plot(steps, values, linewidth=1.5)
    for segment in schedule.segments[:-1]:
        axes.axvline(segment.end, color="grey", linestyle=":", linewidth=0.8)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("learning rate" if base_lr is not None else "LR multiplier")
    axes.set_xlim(0, end)
    axes.grid(alpha=0.3)
    if title:
        axes.set_title(title)
    figure.savefig(Path(path), format="png")
