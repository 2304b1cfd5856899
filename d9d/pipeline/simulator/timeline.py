"""Timeline picture of a simulation: one row per rank, one box per action, coloured by kind.

Forward is blue, full backward orange, input backward yellow, weight backward green; a rank's second stage
(interleaved and V schedules) is drawn darker. Overlapped forward+backward pairs show the forward in the
upper half and the backward in the lower half. Boxes carry their microbatch number.
"""

from __future__ import annotations

from pathlib import Path

from d9d.pipeline.schedule.actions import Compute, ComputeKind, Overlapped
from d9d.pipeline.simulator.simulate import SimulationResult

_COLORS = {
    ComputeKind.FORWARD: (0.35, 0.6, 0.9),
    ComputeKind.BACKWARD: (0.95, 0.55, 0.25),
    ComputeKind.BACKWARD_INPUT: (0.97, 0.8, 0.3),
    ComputeKind.BACKWARD_WEIGHT: (0.45, 0.75, 0.45),
}
_NAMES = {
    ComputeKind.FORWARD: "forward",
    ComputeKind.BACKWARD: "backward",
    ComputeKind.BACKWARD_INPUT: "backward input",
    ComputeKind.BACKWARD_WEIGHT: "backward weight",
}


def _color(part: Compute, chunk: int) -> tuple[float, float, float]:
    r, g, b = _COLORS[part.kind]
    dim = 1.0 - 0.3 * chunk
    return (r * dim, g * dim, b * dim)


def draw_timeline(result: SimulationResult, path: str | Path, *, dpi: int = 80) -> Path:
    """Write the timeline as a PNG (matplotlib's Agg canvas: no display, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    program = result.program
    ranks = program.num_ranks
    width = min(16.0, max(6.0, result.makespan * 0.12))
    fig = Figure(figsize=(width, 0.55 * ranks + 1.3), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    chunk_of = {
        s: program.placement.stages_of(program.placement.rank_of(s)).index(s)
        for s in range(program.num_stages)
    }
    used: set[ComputeKind] = set()
    for rank, timeline in enumerate(result.timeline):
        y = ranks - 1 - rank
        for timed in timeline:
            parts = timed.action.parts if isinstance(timed.action, Overlapped) else (timed.action,)
            height = 0.8 / len(parts)
            for i, part in enumerate(parts):
                bottom = y - 0.4 + (len(parts) - 1 - i) * height
                ax.broken_barh(
                    [(timed.start, timed.end - timed.start)],
                    (bottom, height),
                    facecolors=_color(part, chunk_of[part.stage]),
                    edgecolor="white",
                    linewidth=0.5,
                )
                used.add(part.kind)
                if timed.end - timed.start >= 0.6:
                    ax.text(
                        (timed.start + timed.end) / 2,
                        bottom + height / 2,
                        str(part.microbatch),
                        ha="center",
                        va="center",
                        fontsize=6,
                    )
    ax.set_yticks(range(ranks), [f"rank {ranks - 1 - y}" for y in range(ranks)])
    ax.set_xlim(0, result.makespan)
    ax.set_xlabel("time (F = 1)")
    ax.set_title(
        f"{program.name}: pp={ranks}, {program.num_microbatches} microbatches, "
        f"bubble {100 * result.bubble_fraction:.1f}%",
        fontsize=10,
    )
    ax.legend(
        handles=[Patch(color=_COLORS[k], label=_NAMES[k]) for k in ComputeKind if k in used],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.35 if ranks > 2 else -0.6),
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
