"""Long-context training on one GPU: the longest sequence the Qwen3-0.6B shape trains at with cp = 1, and
tokens/s at 32k.

    python benchmarks/long_context.py [--start 4096] [--max 262144] [--throughput-seq 32768]
        [--steps 4] [--warmup 2] [--eager] [--ac none|full|selective|selective-op|selective-mix]
        [--row-timeout 900] [--out FILE]
    python benchmarks/long_context.py --cpu-smoke      # a tiny shape on CPU: checks the script, no numbers

Every row trains the real engine (`d9d.engine.Trainer`: bf16 parameters, fused AdamW, no clipping, the
engine's default regional compile on CUDA unless `--eager`) on one row of random tokens of the given
length (batch 1, `microbatch_size` 1), in its own subprocess so an out-of-memory row cannot poison the
next. The search doubles the length from `--start` until a row runs out of memory (or `--max`); the
longest row that trained is the answer. Then `--throughput-seq` is timed over `--steps` steps after
`--warmup`. Attention is the `auto` backend (flash_attn / SDPA causal on plain causal rows). Context
parallelism over several GPUs divides the activations by cp (the K/V of the whole sequence excepted,
docs/parallelism.md); those numbers belong to the multi-GPU benchmark.

`--ac` sets the job's activation checkpointing (`throughput.common.AC_MODES`: `full` every layer, `selective`
every second layer, `selective-op` the op-level policy, `selective-mix` every second layer whole and the
others op-level); run once per mode for the longest sequence of each.

Needs CUDA except with `--cpu-smoke`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from throughput.common import (  # benchmarks/ is on sys.path
    AC_MODES,
    ARCHS,
    AcMode,
    StepMarks,
    d9d_ac_section,
    one_rank_env,
)

TINY = {
    "vocab_size": 256,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
}


def train_row(
    seq_len: int, steps: int, warmup: int, eager: bool, smoke: bool, ac: AcMode = "none"
) -> dict[str, Any]:
    """In the child: train `warmup + steps` steps at `seq_len`; median step time, tokens/s, peak memory."""
    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.config import parse_config
    from d9d.engine.events import StepStarted
    from d9d.engine.trainer import Trainer

    cuda = torch.cuda.is_available() and not smoke
    if not cuda and not smoke:
        raise RuntimeError("this benchmark needs CUDA (or --cpu-smoke)")
    arch = TINY if smoke else ARCHS["dense"]
    one_rank_env()
    config = parse_config(
        {
            "run": {"name": "long-context", "dir": tempfile.mkdtemp(prefix="d9d-long-")},
            "batching": {"global_batch_size": 1, "microbatch_size": 1},
            "trainer": {"total_steps": warmup + steps + 1},
            "logging": {"progress_bar": "off", "period": 1000},
            "checkpointing": {"save_at_end": False},
            "gradient_clipping": {"max_norm": None},
            "model": {
                "provider": "qwen3",
                "options": {
                    "architecture": {**arch, "max_position_embeddings": max(40960, seq_len)},
                    "dtype": "float32" if smoke else "bfloat16",
                },
            },
            "data": {
                "provider": "throughput.data:RandomTokens",
                "options": {"seq_len": seq_len, "vocab_size": arch["vocab_size"]},
            },
            "optimizer": {"provider": "adamw", "options": {"lr": 1e-4, "weight_decay": 0.0}},
            "compile": {"enabled": False if eager else None},  # None: the engine's default
            "activation_checkpointing": d9d_ac_section(ac),
        }
    )
    ctx = DistributedContext.create(DeviceMeshParameters(), backend="nccl" if cuda else "gloo")
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 1))
    marks = StepMarks(cuda)  # the run has one step more than it times: each ends where the next starts
    trainer.events.subscribe(StepStarted, marks)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.setup()
    trainer.train()
    durations = marks.durations()
    times = [durations[s] for s in range(warmup + 1, warmup + steps + 1)]
    step = sorted(times)[len(times) // 2]
    return {
        "seq_len": seq_len,
        "median_step_s": step,
        "tokens_per_s": seq_len / step,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }


def child_main(args: argparse.Namespace) -> None:
    try:
        result = train_row(args.one_row, args.steps, args.warmup, args.eager, args.cpu_smoke, args.ac)
    except torch.OutOfMemoryError as e:
        result = {"seq_len": args.one_row, "oom": True, "error": str(e)[:300]}
    except Exception as e:  # the parent's table shows it; the traceback goes to stderr
        traceback.print_exc()
        result = {"seq_len": args.one_row, "error": f"{type(e).__name__}: {e}"[:600]}
    Path(args.row_out).write_text(json.dumps(result))


def spawn(seq_len: int, args: argparse.Namespace, steps: int, warmup: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--one-row", str(seq_len), "--row-out", str(out)]
        cmd += ["--steps", str(steps), "--warmup", str(warmup)]
        cmd += ["--eager"] * args.eager + ["--cpu-smoke"] * args.cpu_smoke + ["--ac", args.ac]
        proc = subprocess.Popen(cmd, start_new_session=True)  # own session: a timeout ends compile workers
        try:
            proc.wait(timeout=args.row_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"seq_len": seq_len, "error": f"timed out after {args.row_timeout} s"}
        if not out.exists():
            # a CUDA OOM can also kill the process outright (e.g. inside NCCL or the allocator)
            return {
                "seq_len": seq_len,
                "error": f"exited with code {proc.returncode} before writing a result",
            }
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--max", type=int, default=262144)
    parser.add_argument("--throughput-seq", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--eager", action="store_true", help="no regional torch.compile (default: on CUDA)")
    parser.add_argument("--ac", choices=AC_MODES, default="none", help="activation checkpointing mode")
    parser.add_argument("--row-timeout", type=float, default=900.0)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shape on CPU, short lengths")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one-row", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--row-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_row is not None:
        child_main(args)
        return
    if args.cpu_smoke:
        args.start, args.max, args.throughput_seq = 64, 128, 128
    search: list[dict[str, Any]] = []
    seq = args.start
    while seq <= args.max:
        row = spawn(seq, args, steps=1, warmup=1)  # the second step has the optimizer state allocated
        search.append(row)
        print(json.dumps(row), flush=True)
        if "error" in row:
            break
        seq *= 2
    trained = [r["seq_len"] for r in search if "error" not in r]
    throughput = spawn(args.throughput_seq, args, steps=args.steps, warmup=args.warmup)
    print(json.dumps(throughput), flush=True)
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu_smoke else "cpu",
        "torch": torch.__version__,
        "shape": "tiny (smoke)" if args.cpu_smoke else "Qwen3-0.6B",
        "compile": "off" if args.eager else "engine default (on for CUDA)",
        "activation_checkpointing": args.ac,
        "longest_trained_seq": max(trained) if trained else None,
        "first_failure": next((r for r in search if "error" in r), None),
        "search": search,
        "throughput": throughput,
    }
    print(json.dumps({k: report[k] for k in ("longest_trained_seq", "throughput")}, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
