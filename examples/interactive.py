"""Drive a training run from a Ray client the way a notebook user would: start a tiny Qwen3-MoE on two CPU
rank actors, watch its metrics, pause it, force a checkpoint, put it to sleep (its training state in host
memory) and wake it, change the learning rate, resume, stop.

    python examples/interactive.py                              # a local Ray instance
    python examples/interactive.py --address ray://HEAD:10001   # a cluster (or set RAY_ADDRESS)
    python examples/interactive.py --small                      # fewer steps between commands (CI)

Each cell of a notebook would be one block of `main()`. Every command takes effect at the next step boundary
of the run; the script checks that each transition really happened and exits non-zero if not. Through a Ray
client the ranks run on the cluster: the text file and the run directory must exist on its nodes.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from d9d.cluster import JobState, JobStatus, TrainingJob, connect, disconnect

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "examples" / "perplexity" / "sample.txt"  # any text file; one document per line
LR, NEW_LR = 3e-3, 1e-3


def job_config(run_dir: Path) -> dict[str, Any]:
    """The job file as a dict: the engine config plus a `cluster:` section."""
    return {
        "run": {"name": "interactive-example", "dir": str(run_dir)},
        "mesh": {"data_parallel_replicate": 2},
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 10_000},  # far more than we let it run: we stop it ourselves
        "model": {
            "provider": "qwen3_moe",
            "options": {
                "architecture": {
                    "vocab_size": 259,
                    "hidden_size": 32,
                    "num_layers": 2,
                    "num_attention_heads": 4,
                    "num_kv_heads": 2,
                    "head_dim": 8,
                    "intermediate_size": 64,
                    "moe_intermediate_size": 16,
                    "num_experts": 4,
                    "num_experts_per_tok": 2,
                    "expert_bias": True,
                }
            },
        },
        "data": {"provider": "text", "options": {"dataset": {"paths": [str(TEXT)], "max_length": 64}}},
        "task": {"provider": "causal_lm"},
        "optimizer": {"provider": "adamw", "options": {"lr": LR}},  # no LR schedule: lr stays put
        "checkpointing": {"period": None, "save_at_end": True},  # only when asked and at the end
        "logging": {"period": 1, "progress_bar": "off"},  # metrics: MLflow, sqlite in the run dir
        "cluster": {"resources": {"cpus": 1, "gpus": 0}},
    }


class Watcher:
    """Prints new train metrics and remembers each step's loss and learning rate."""

    def __init__(self, job: TrainingJob) -> None:
        self.job = job
        self.lr: dict[int, float] = {}

    def drain(self, wait_s: float = 0.2) -> None:
        points, _ = self.job.poll_metrics(wait_s)
        for p in points:
            if p.kind == "train" and "loss" in p.values:
                self.lr[p.step] = p.values["lr"]
                print(f"  step {p.step:4d}  loss {p.values['loss']:.4f}  lr {p.values['lr']:.1e}")

    def until(self, what: str, done: Callable[[JobStatus], bool], timeout_s: float = 120.0) -> JobStatus:
        """Stream metrics until the job's status satisfies `done`."""
        deadline = time.monotonic() + timeout_s
        while not done(status := self.job.status()):
            if status.state.terminal:
                raise RuntimeError(
                    f"the run ended ({status.state.value}) while waiting for {what}: {status.error}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:.0f}s; status {status}")
            self.drain()
        self.drain(0.0)
        return status

    def settle(self, status: JobStatus, quiet_s: float = 1.5) -> JobStatus:
        """Wait until no step has completed for `quiet_s` seconds."""
        since = time.monotonic()
        while time.monotonic() - since < quiet_s:
            self.drain()
            now = self.job.status()
            if now.step != status.step:
                status, since = now, time.monotonic()
        return status


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)
    print(f"ok: {message}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--address", help="Ray cluster (default: RAY_ADDRESS, else a local instance)")
    parser.add_argument("--run-dir", type=Path, default=REPO / "runs" / "interactive-example")
    parser.add_argument("--small", action="store_true", help="3 steps between commands instead of 10 (CI)")
    args = parser.parse_args()
    run_dir = args.run_dir.resolve()
    every = 3 if args.small else 10
    if (run_dir / "checkpoints").is_dir() or (run_dir / "run_summary.json").is_file():
        shutil.rmtree(run_dir)  # an earlier run of this example: start afresh, not from its checkpoint

    # -- cell 1: connect and start ----------------------------------------------------------------------
    connect(args.address, local_cpus=2)
    try:
        job = TrainingJob(job_config(run_dir)).start()
        watch = Watcher(job)
        print(f"started {job.run_name} on {job.spec.initial_workers} rank actors")
        status = watch.until(f"step {every}", lambda s: s.step >= every)
        check(status.state is JobState.RUNNING, f"running at step {status.step}")

        # -- cell 2: pause ------------------------------------------------------------------------------
        job.pause()
        # PAUSED is the requested state; the ranks stop at their next step boundary, a step or so later.
        paused = watch.until("the pause", lambda s: s.state is JobState.PAUSED)
        paused = watch.settle(paused)
        check(paused.state is JobState.PAUSED, f"paused at step {paused.step}; no step since")

        # -- cell 3: checkpoint now, while paused -------------------------------------------------------
        job.checkpoint_now()
        saved = watch.until("the checkpoint", lambda s: s.latest_checkpoint_step == paused.step)
        check(saved.state is JobState.PAUSED, f"checkpoint of step {paused.step} committed while paused")

        # -- cell 4: sleep and wake, still paused -------------------------------------------------------
        # Asleep, the ranks hold their parameters, gradients and optimizer state in (pinned) host memory and
        # the devices are free for something else; waking restores them bit for bit.
        job.sleep()
        asleep = watch.until("the sleep", lambda s: s.asleep)
        check(asleep.state is JobState.PAUSED, f"asleep at step {asleep.step}: training state in host memory")
        job.wake()
        awake = watch.until("the wake", lambda s: not s.asleep)
        check(awake.state is JobState.PAUSED and awake.step == paused.step, "awake, still paused")

        # -- cell 5: a new learning rate, then resume ---------------------------------------------------
        job.update(lr=NEW_LR)
        time.sleep(1.0)  # let the paused ranks pick the update up on its own (they poll a few times a second)
        job.resume()
        resumed = watch.until("training to go on", lambda s: s.step >= paused.step + every)
        check(resumed.state is JobState.RUNNING, f"resumed: step {resumed.step}")
        before = [lr for step, lr in watch.lr.items() if step <= paused.step]
        after = [lr for step, lr in watch.lr.items() if step > paused.step]
        check(
            all(math.isclose(lr, LR) for lr in before)
            and bool(after)
            and all(math.isclose(lr, NEW_LR) for lr in after),
            f"learning rate {LR:g} before the update, {NEW_LR:g} after",
        )

        # -- cell 6: stop and read the result -----------------------------------------------------------
        job.stop()
        summary = job.result(timeout=120)
        watch.drain(0.0)
        final = job.status()
        print(
            f"result: {summary.status} after {summary.steps} steps, final loss {summary.final_loss:.4f}, "
            f"{summary.restarts} restarts"
        )
        check(summary.status == "stopped" and final.state is JobState.STOPPED, "stopped on request")
        check(summary.steps >= resumed.step and summary.steps < 10_000, f"stopped at step {summary.steps}")
        losses = [summary.losses[s] for s in sorted(summary.losses)]
        check(sum(losses[-3:]) < sum(losses[:3]), "the loss went down")
        check(
            (run_dir / "checkpoints" / f"step-{paused.step:08d}").is_dir(),
            f"checkpoint step-{paused.step:08d} on disk",
        )
    finally:
        disconnect()
    print("interactive session: every transition happened")
    return 0


if __name__ == "__main__":
    sys.exit(main())
