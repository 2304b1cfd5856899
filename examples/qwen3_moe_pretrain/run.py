"""Train the tiny Qwen3-MoE on 4 CPU rank actors of a local Ray instance and check that it learned.

    python examples/qwen3_moe_pretrain/run.py [--steps 20] [--address ray://head:10001]

The same job is what `make demo` / `d9d demo` / `d9d train examples/qwen3_moe_pretrain/tiny.yaml --cpu` run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from d9d.cluster import TrainingJob, connect, disconnect


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--address", default=None, help="a Ray cluster; default: a local Ray instance")
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="d9d-pretrain-")
    job = TrainingJob(
        "examples/qwen3_moe_pretrain/tiny.yaml",
        overrides=[f"trainer.total_steps={args.steps}", f"run.dir={run_dir}"],
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
    if summary.status != "finished" or summary.steps != args.steps or not losses[-1] < 0.9 * losses[0]:
        print("FAILED: the tiny model did not train as expected", file=sys.stderr)
        return 1
    print("OK: loss dropped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
