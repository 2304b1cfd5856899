"""The training stall of a checkpoint step, synchronous against asynchronous (`checkpointing.async`).

    python benchmarks/checkpoint_stall.py [--model dense|tiny] [--save-step 8] [--after 7] [--out FILE]

Each mode (`sync`, then `async`) trains in its own subprocess through the real engine (`d9d.engine.Trainer`,
bf16 parameters, AdamW, eager) on random tokens, with one periodic checkpoint at `--save-step` and
`--after` steps behind it (no save at the end). Reported per mode:

- `stall_s`: the engine's `checkpoint/stall_s` metric: the time the step thread spent in the save (for
  `sync` the whole save: DCP write + hashing + commit; for `async` the staging to pinned host memory);
- `write_s` (async): the background write, `checkpoint/write_s`; `committed_after`: the step boundary
  at which the commit happened (`final` when the end-of-training wait took it), `commit_s` its time on
  the step thread (`checkpoint/commit_s`);
- `base_step_s`: the median step period (start of one step to the start of the next, a CUDA sync at each
  start) of the steps before the save; `save_step_s`: the period of the checkpoint step (the save and, for
  async, the device-to-host copies included); `inflation_s`: how much longer the checkpoint step and the
  `--after` steps took together than as many base steps (training slowed by the background write
  included).

The summary prints `async stall / sync save` (the issue's target: at most 10% for the 0.6B model on one GPU).
`--model dense` is Qwen3-0.6B (`throughput/common.py` ARCHS['dense'], batch 8 x 2048) and needs CUDA;
`--model tiny` is a 2-layer toy that runs on CPU in seconds (a smoke test of the script, not a number).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from throughput.common import (  # benchmarks/ is the script's directory: on sys.path
    ARCHS,
    BATCH,
    SEQ,
    TINY,
    TINY_BATCH,
    TINY_SEQ,
    StepMarks,
    one_rank_env,
)


def job(model: str, mode: str, save_step: int, after: int, run_dir: Path) -> dict[str, Any]:
    arch = ARCHS["dense"] if model == "dense" else TINY
    batch, seq = (BATCH, SEQ) if model == "dense" else (TINY_BATCH, TINY_SEQ)
    return {
        "run": {"name": f"stall-{mode}", "dir": str(run_dir)},
        "batching": {"global_batch_size": batch, "microbatch_size": batch},
        "trainer": {"total_steps": save_step + after},
        "logging": {"progress_bar": "off", "period": 1000},
        "checkpointing": {"period": save_step, "save_at_end": False, "async": mode == "async"},
        "gradient_clipping": {"max_norm": None},
        "model": {
            "provider": "qwen3",
            "options": {
                "architecture": {**arch, "max_position_embeddings": seq},
                "dtype": "bfloat16" if model == "dense" else "float32",
            },
        },
        "data": {
            "provider": "throughput.data:RandomTokens",
            "options": {"vocab_size": arch["vocab_size"], "seq_len": seq},
        },
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-4, "weight_decay": 0.0}},
        "compile": {"enabled": False},
    }


def child(model: str, mode: str, save_step: int, after: int) -> dict[str, Any]:
    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.config import parse_config
    from d9d.engine.events import CheckpointSaved, StepStarted, TrainingFinished
    from d9d.engine.runtime import MetricPoint
    from d9d.engine.trainer import Trainer

    cuda = torch.cuda.is_available()
    run_dir = Path(tempfile.mkdtemp(prefix="d9d-stall-"))
    config = parse_config(job(model, mode, save_step, after, run_dir))
    metrics: dict[str, float] = {}

    def sink(point: MetricPoint) -> None:  # the measured save's timings only
        if point.step == save_step:
            metrics.update({k: v for k, v in point.values.items() if k.startswith("checkpoint/")})

    one_rank_env()
    ctx = DistributedContext.create(DeviceMeshParameters())
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 1, metrics_sink=sink))
    marks = StepMarks(cuda)
    committed: dict[str, Any] = {}

    def on_saved(event: CheckpointSaved) -> None:
        # The step that had run when the commit happened; the last step's boundary is the final wait.
        done = trainer.progress.step
        committed["after"] = "final" if done == save_step + after else done

    trainer.events.subscribe(StepStarted, marks)
    trainer.events.subscribe(TrainingFinished, lambda event: marks.mark(event.step + 1))  # closes the last
    trainer.events.subscribe(CheckpointSaved, on_saved)
    trainer.setup()
    trainer.train()
    durations = marks.durations()
    periods = {s: durations[s] for s in range(1, save_step + after + 1)}
    # The first steps warm up (allocator, kernels): the base is the median of the later ones before the save.
    before = sorted(periods[s] for s in range(min(3, save_step - 1), save_step))
    base = before[len(before) // 2]
    around = [periods[s] for s in range(save_step, save_step + after + 1)]
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    return {
        "mode": mode,
        "stall_s": metrics.get("checkpoint/stall_s"),
        "write_s": metrics.get("checkpoint/write_s"),
        "commit_s": metrics.get("checkpoint/commit_s"),
        "committed_after": committed.get("after"),
        "base_step_s": base,
        "save_step_s": periods[save_step],
        "inflation_s": sum(around) - base * len(around),
        "checkpoint_gib": size / 2**30,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("dense", "tiny"), default="dense")
    parser.add_argument("--save-step", type=int, default=8)
    parser.add_argument(
        "--after",
        type=int,
        default=7,
        help="steps after the checkpoint step (fewer than --save-step: the period would save again)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--child", choices=("sync", "async"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save_step < 3 or args.after < 1:
        parser.error("--save-step must be at least 3 (two warm-up steps) and --after at least 1")
    if args.after >= args.save_step:
        parser.error("--after must be below --save-step: one periodic save per run is measured")
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.model, args.child, args.save_step, args.after)), flush=True)
        return
    if args.model == "dense" and not torch.cuda.is_available():
        parser.error("--model dense needs CUDA (use --model tiny for a CPU smoke test)")
    results = []
    for mode in ("sync", "async"):
        cmd = [sys.executable, __file__, "--child", mode, "--model", args.model]
        cmd += ["--save-step", str(args.save_step), "--after", str(args.after)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode != 0 or not lines:
            sys.exit(f"{mode} run failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
        # The one-time allocation of the staging buffers after the first step (not in any stall above).
        for line in out.stderr.splitlines():
            if "checkpoint staging:" in line:
                print(f"{mode}: {line.split('] ', 1)[-1]}")
    sync, asyn = results
    print(f"model {args.model} on {sync['device']}, checkpoint {sync['checkpoint_gib']:.2f} GiB")
    print("mode     stall_s   write_s  base_step_s  save_step_s  inflation_s")
    for r in results:
        write = "-" if r["write_s"] is None else f"{r['write_s']:.3f}"
        print(
            f"{r['mode']:6} {r['stall_s']:9.3f} {write:>9} {r['base_step_s']:12.3f} "
            f"{r['save_step_s']:12.3f} {r['inflation_s']:12.3f}"
        )
    ratio = asyn["stall_s"] / sync["stall_s"]
    print(
        f"synchronous save {sync['stall_s']:.3f} s; async stall {asyn['stall_s']:.3f} s = {ratio:.1%} of it"
    )
    print(f"async commit after step {asyn['committed_after']} ({asyn['commit_s']:.3f} s on the step thread)")
    if args.out is not None:
        args.out.write_text(json.dumps({"results": results, "async_stall_over_sync_save": ratio}, indent=1))


if __name__ == "__main__":
    main()
