"""How long a full garbage collection takes in a training rank, with and without `gc.freeze`.

    python benchmarks/gc_pause.py [--layers 28] [--width 64] [--eager] [--out FILE]

One rank trains a Qwen3-shaped model (`--layers` layers of hidden size `--width`: the Python objects the
collector walks grow with the layers and the compiled graphs, not with the width) through the real engine
(`Trainer`, compiled unless `--eager`; gloo on CPU, NCCL on a GPU), with the engine's own freezing off
(`gc.freeze: false`), for three steps. At the start of the third step it counts the objects the collector
tracks and times, in this order: a full collection, a collection of the young generations (what
torchtitan's periodic collection runs), and a full collection after `gc.freeze()` (what the engine does
after the first step by default, `GCConfig.freeze`), then unfreezes. Each is the time the rank's training
thread would stand still; in a multi-rank job every other rank waits for it at the next collective.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from throughput.common import one_rank_env  # benchmarks/ is the script's directory: on sys.path

REPO = Path(__file__).resolve().parent.parent


def _timed(collect: Callable[[], object]) -> float:
    start = time.perf_counter()
    collect()
    return (time.perf_counter() - start) * 1e3


def measure(layers: int, width: int, compiled: bool) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))  # the tests' data fixture
    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.config import parse_config
    from d9d.engine.events import StepStarted
    from d9d.engine.trainer import Trainer

    one_rank_env()
    heads = max(width // 16, 1)
    config = parse_config(
        {
            "run": {"name": "gc-pause", "dir": tempfile.mkdtemp(prefix="gc-pause-")},
            "batching": {"global_batch_size": 2, "microbatch_size": 2},
            "trainer": {"total_steps": 3},
            "logging": {"progress_bar": "off", "period": 1000},
            "checkpointing": {"save_at_end": False},
            "gc": {"freeze": False},
            "model": {
                "provider": "qwen3",
                "options": {
                    "architecture": {
                        "vocab_size": 256,
                        "hidden_size": width,
                        "num_layers": layers,
                        "num_attention_heads": heads,
                        "num_kv_heads": max(heads // 2, 1),
                        "head_dim": 16,
                        "intermediate_size": 2 * width,
                    }
                },
            },
            "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
            "optimizer": {"provider": "adamw", "options": {"lr": 1e-3}},
            "compile": {"enabled": compiled},
        }
    )
    ctx = DistributedContext.create(DeviceMeshParameters())
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 1))
    out: dict[str, Any] = {"layers": layers, "width": width, "compiled": compiled, "device": str(ctx.device)}

    def at_start(event: StepStarted) -> None:
        if event.step != 3:
            return
        out["tracked_objects"] = len(gc.get_objects())
        out["full_ms"] = _timed(gc.collect)
        out["young_ms"] = _timed(lambda: gc.collect(1))
        gc.freeze()
        out["frozen_objects"] = gc.get_freeze_count()
        out["full_frozen_ms"] = _timed(gc.collect)
        gc.unfreeze()

    trainer.events.subscribe(StepStarted, at_start)
    trainer.setup()
    trainer.train()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--eager", action="store_true", help="no regional torch.compile")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args.layers, args.width, not args.eager)
    result["torch"] = torch.__version__
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
