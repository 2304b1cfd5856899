"""The pipeline bubble of a benchmark row: measured from the ranks' probe records (`throughput.probe`) and
predicted by d9d's schedule simulator (what `d9d pipeline-sim` runs) for the same program.

measured = mean over ranks of the median over the timed steps of 1 − (Σ the rank's pass times) / (the span
of its pipeline program); predicted = the simulator's bubble (idle time of all ranks over ranks ×
makespan) with the measured median time of each pass kind per stage (`sim`), and with unit costs F = I = W
= 1 (`sim unit`, what `d9d pipeline-sim --schedule K --pp P --microbatches M` prints). `benchmarks/
multi_gpu.py` documents what is inside a pass and a span.
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
    per_rank: list[float] = []
    costs: dict[tuple[int, str], list[float]] = {}
    for record in records:
        bubbles = []
        for step in steps:
            entry = record["pipeline"].get(step)
            if entry is None or entry["span_s"] <= 0:
                continue
            bubbles.append(1.0 - sum(seconds for _, _, seconds in entry["passes"]) / entry["span_s"])
            for kind, stage, seconds in entry["passes"]:
                costs.setdefault((int(stage), kind), []).append(seconds)
        if bubbles:
            per_rank.append(statistics.median(bubbles))
    if not per_rank:
        return {"error": "no pipeline step was recorded"}
    medians = {f"{stage}{kind}": statistics.median(v) for (stage, kind), v in sorted(costs.items())}
    program = build_schedule(
        TypeAdapter(ScheduleConfig).validate_python({"kind": schedule}), pp, microbatches
    )
    return {
        "microbatches": microbatches,
        "bubble_measured": statistics.fmean(per_rank),
        "bubble_measured_per_rank": per_rank,
        "bubble_sim": simulate(program, StageCosts(per_stage=medians)).bubble_fraction,
        "bubble_sim_unit": simulate(program, ActionCosts()).bubble_fraction,
        "pass_median_s": medians,
    }
