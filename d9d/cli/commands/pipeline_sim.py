"""`d9d pipeline-sim`: simulate a schedule, print its bubble table and draw its timeline."""

from __future__ import annotations

import argparse
import sys
from typing import Any

_KINDS = ["inference", "gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev"]


def _run(args: argparse.Namespace) -> int:
    from pydantic import TypeAdapter, ValidationError

    from d9d.pipeline.schedule.config import ScheduleConfig, build_schedule
    from d9d.pipeline.simulator.costs import ActionCosts
    from d9d.pipeline.simulator.report import format_report
    from d9d.pipeline.simulator.simulate import simulate
    from d9d.pipeline.simulator.timeline import draw_timeline

    raw: dict[str, Any] = {"kind": args.schedule}
    if args.stages_per_rank is not None:
        raw["stages_per_rank"] = args.stages_per_rank
    try:
        config = TypeAdapter(ScheduleConfig).validate_python(raw)
        costs = ActionCosts(
            forward=args.forward,
            backward_input=args.backward_input,
            backward_weight=args.backward_weight,
            backward_full=args.backward_full,
            overlap_factor=args.overlap_factor,
            communication=args.communication,
        )
        program = build_schedule(config, args.pp, args.microbatches)
    except (ValidationError, ValueError) as e:
        print(f"d9d pipeline-sim: {e}", file=sys.stderr)
        return 2
    result = simulate(program, costs)
    print(format_report(result))
    output = args.output or f"pipeline_{config.kind}_pp{args.pp}_m{args.microbatches}.png"
    print(f"timeline written to {draw_timeline(result, output)}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pipeline-sim", help="simulate a pipeline schedule: bubble table and timeline picture"
    )
    parser.add_argument("--schedule", required=True, choices=_KINDS, help="the schedule to simulate")
    parser.add_argument("--pp", type=int, required=True, help="pipeline-parallel ranks")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches per step")
    parser.add_argument("--stages-per-rank", type=int, help="interleaved_1f1b and inference only")
    parser.add_argument("-o", "--output", help="PNG path (default: pipeline_<schedule>_pp<P>_m<M>.png)")
    costs = parser.add_argument_group("costs per stage and microbatch")
    costs.add_argument("--forward", type=float, default=1.0, help="forward time (default: 1)")
    costs.add_argument(
        "--backward-input", type=float, default=1.0, help="input-gradient backward time (default: 1)"
    )
    costs.add_argument(
        "--backward-weight", type=float, default=1.0, help="weight-gradient backward time (default: 1)"
    )
    costs.add_argument("--backward-full", type=float, help="default: backward-input + backward-weight")
    costs.add_argument("--overlap-factor", type=float, default=1.0, help="cost share of an overlapped pair")
    costs.add_argument("--communication", type=float, default=0.0, help="latency of one transfer")
    parser.set_defaults(handler=_run)
