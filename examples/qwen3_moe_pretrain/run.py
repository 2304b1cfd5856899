"""Train the tiny Qwen3-MoE on 4 CPU rank actors of a local Ray instance and check that it learned.

    python examples/qwen3_moe_pretrain/run.py [--small] [--run-dir DIR] [--address ray://head:10001]

The same job is what `make demo` / `d9d demo` / `d9d train examples/qwen3_moe_pretrain/tiny.yaml --cpu` run.
Its outputs go to `runs/qwen3-moe-pretrain-example/` (or `--run-dir`); a rerun starts afresh there.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from d9d.cluster import TrainingJob, connect, disconnect

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="10 steps instead of 20 (CI)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: 20, --small: 10)")
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=REPO / "runs" / "qwen3-moe-pretrain-example",
        help="where the run writes (default: runs/qwen3-moe-pretrain-example)",
    )
    parser.add_argument("--address", default=None, help="a Ray cluster; default: a local Ray instance")
    args = parser.parse_args()
    steps = args.steps or (10 if args.small else 20)
    run_dir = args.run_dir.resolve()
    if (run_dir / "checkpoints").is_dir() or (run_dir / "run_summary.json").is_file():
        shutil.rmtree(run_dir)  # an earlier run of this example: start afresh, not from its checkpoint
    job = TrainingJob(
        REPO / "examples" / "qwen3_moe_pretrain" / "tiny.yaml",
        overrides=[
            f"trainer.total_steps={steps}",
            f"run.dir={run_dir}",
            "run.name=qwen3-moe-pretrain-example",
        ],
        cpu=True,
    )
    connect(args.address, local_cpus=4)
    try:
        job.start()
        losses = [p.values["loss"] for p in job.metrics() if p.kind == "train" and "loss" in p.values]
        summary = job.result()
    finally:
        disconnect()
    print(f"losses every 5 steps: {[round(x, 3) for x in losses]}")
    print(f"summary: status={summary.status} steps={summary.steps} final_loss={summary.final_loss:.4f}")
    if summary.status != "finished" or summary.steps != steps or not losses[-1] < 0.9 * losses[0]:
        print("FAILED: the tiny model did not train as expected", file=sys.stderr)
        return 1
    print(f"OK: loss dropped; the run is in {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
