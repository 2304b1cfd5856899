"""Plain-text summary of a simulation: per-rank busy and idle time, bubble fraction, peak activations."""

from __future__ import annotations

from d9d.pipeline.simulator.simulate import SimulationResult


def format_report(result: SimulationResult) -> str:
    program, costs = result.program, result.costs
    stages_per_rank = program.num_stages // program.num_ranks
    lines = [
        f"{program.name}: pp={program.num_ranks} microbatches={program.num_microbatches} "
        f"stages/rank={stages_per_rank}  costs F={costs.forward:g} I={costs.backward_input:g} "
        f"W={costs.backward_weight:g} comm={costs.communication:g}",
        f"{'rank':>4} {'busy':>8} {'idle':>8} {'bubble':>7} {'peak act.':>9}",
    ]
    for r in result.ranks:
        bubble = f"{100 * r.bubble_fraction:>6.1f}%"
        lines.append(f"{r.rank:>4} {r.busy:>8.4g} {r.idle:>8.4g} {bubble} {r.peak_activations:>9}")
    lines.append(
        f"step time {result.makespan:g}, pipeline bubble {100 * result.bubble_fraction:.1f}%, "
        f"peak activations {result.peak_activations} (stage-microbatches)"
    )
    return "\n".join(lines)
