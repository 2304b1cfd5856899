"""One PNG of a run's curves: loss (train and eval), learning rate, gradient norm and tokens per second."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from d9d.core.files import atomic_write_bytes

PLOT_FILE = "plots/training.png"
# (panel title, series drawn in it); the first series of a panel is the main one.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("train/loss", "eval/loss")),
    ("learning rate", ("train/lr",)),
    ("gradient norm", ("train/grad_norm",)),
    ("tokens / s", ("train/tokens_per_s",)),
)


def plot_history(history: Mapping[str, Mapping[int, float]], path: Path, title: str | None = None) -> Path:
    """Write the 2×2 panel PNG to `path` (atomically); a panel without data says so."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 6.4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas: no display, no global pyplot state
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
        if drawn:
            if len(names) > 1:
                axes.legend(fontsize=8)
        else:
            axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes, color="grey")
        axes.set_title(panel)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())
    return path
