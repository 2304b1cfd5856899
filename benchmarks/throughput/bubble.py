"""The pipeline bubble of a benchmark row: measured from the ranks' probe records (`throughput.probe`) and
predicted by d9d's schedule simulator (what `d9d pipeline-sim` runs) for the same program.

measured = the median over the timed steps of 1 − (Σ over ranks of their pass times) / (ranks × the
longest rank's span of its pipeline program): the simulator's quantity, idle time of all ranks over ranks ×
makespan, with the step's makespan taken as its longest span (every rank starts its program at the step's
start; a rank that finishes first, as 1F1B's last stage does by one backward of the first, idles until the
step's end). Until session 33 each rank's share was taken over its own span and averaged, which left that
tail out: at 2 microbatches of pp 2 1F1B it read 30% where the step-wide share was 38% (docs/benchmarks.md).
Each rank's share of its own span stays in the result (`bubble_own_span_per_rank`). The spans are event
times on each rank's own GPU, with no common clock: a rank whose host starts its program late has a
shorter span, and the longest span then falls short of the makespan (in session 33's rows the first
stage's span was up to 15% shorter than the last's at 1- and 2-sequence microbatches).
predicted = the simulator's bubble with the measured median time of each pass kind per stage (`sim`), and
with unit costs F = I = W = 1 (`sim unit`, what `d9d pipeline-sim --schedule K --pp P --microbatches M`
prints). `benchmarks/multi_gpu.py` documents what is inside a pass and a span.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from pydantic import Field, TypeAdapter

from d9d.pipeline.schedule.actions import Compute, ComputeKind
from d9d.pipeline.schedule.config import ScheduleConfig, build_schedule
from d9d.pipeline.simulator.costs import ActionCosts
from d9d.pipeline.simulator.simulate import simulate

_LETTERS = {
    ComputeKind.FORWARD: "F",
    ComputeKind.BACKWARD: "B",
    ComputeKind.BACKWARD_INPUT: "I",
    ComputeKind.BACKWARD_WEIGHT: "W",
}


class StageCosts(ActionCosts):
    """The simulator's costs per stage and pass kind (keys like `3F`, `0W`); a kind a stage never ran falls
    back to its parts (B = I + W), else to that kind's mean over the stages, else to the unit cost."""

    per_stage: dict[str, float] = Field(default_factory=dict)

    def _compute(self, part: Compute) -> float:
        letter = _LETTERS[part.kind]
        own = self.per_stage.get(f"{part.stage}{letter}")
        if own is not None:
            return own
        if letter == "B":
            i, w = self.per_stage.get(f"{part.stage}I"), self.per_stage.get(f"{part.stage}W")
            if i is not None and w is not None:
                return i + w
        same = [v for k, v in self.per_stage.items() if k.endswith(letter)]
        return sum(same) / len(same) if same else super()._compute(part)


def pipeline_bubble(
    records: list[dict[str, Any]], steps: Iterable[int], schedule: str, pp: int, microbatches: int
) -> dict[str, Any]:
    """`records`: the ranks' probe records; `steps`: the timed steps; the program: `schedule` (a
    `pipelining.kind`) on `pp` ranks with `microbatches` per step."""
    steps = list(steps)
    own: list[list[float]] = []  # per rank: 1 − busy / own span, per timed step it recorded
    # per step: (busy, span) of each rank that recorded it
    by_step: dict[int, list[tuple[float, float]]] = {}
    costs: dict[tuple[int, str], list[float]] = {}
    for record in records:
        shares = []
        for step in steps:
            entry = record["pipeline"].get(step)
            if entry is None or entry["span_s"] <= 0:
                continue
            busy = sum(seconds for _, _, seconds in entry["passes"])
            shares.append(1.0 - busy / entry["span_s"])
            by_step.setdefault(step, []).append((busy, entry["span_s"]))
            for kind, stage, seconds in entry["passes"]:
                costs.setdefault((int(stage), kind), []).append(seconds)
        if shares:
            own.append(shares)
    # only the steps every rank recorded: a step-wide share needs all of them
    whole = [ranks for ranks in by_step.values() if len(ranks) == len(records)]
    if not whole:
        return {"error": "no pipeline step was recorded by every rank"}
    step_bubbles = [
        1.0 - sum(busy for busy, _ in ranks) / (len(ranks) * max(span for _, span in ranks))
        for ranks in whole
    ]
    medians = {f"{stage}{kind}": statistics.median(v) for (stage, kind), v in sorted(costs.items())}
    program = build_schedule(
        TypeAdapter(ScheduleConfig).validate_python({"kind": schedule}), pp, microbatches
    )
    return {
        "microbatches": microbatches,
        "bubble_measured": statistics.median(step_bubbles),
        "bubble_own_span_per_rank": [statistics.median(shares) for shares in own],
        "bubble_sim": simulate(program, StageCosts(per_stage=medians)).bubble_fraction,
        "bubble_sim_unit": simulate(program, ActionCosts()).bubble_fraction,
        "pass_median_s": medians,
    }
