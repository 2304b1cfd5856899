"""How the compiled decoder blocks behave on this machine: graphs, recompiles and graph breaks (with their
reasons) over a few engine steps. A regional compile that works shows one graph per block kind.

    python benchmarks/compile_probe.py [--model dense|moe] [--layers 10] [--seq 256] [--steps 3]

Runs the real engine (`d9d.engine.Trainer`, `compile: {enabled: true}`) on the benchmark's model shapes
with fewer layers and a short sequence, and prints dynamo's recompile and graph-break reasons.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch._logging
from throughput import common, d9d_peer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["dense", "moe"], default="moe")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    common.one_rank_env()
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    common.SEQ = d9d_peer.SEQ = args.seq
    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.config import parse_config
    from d9d.engine.trainer import Trainer

    arch = {**common.ARCHS[args.model], "num_layers": args.layers, "max_position_embeddings": args.seq}
    config = parse_config(
        {
            "run": {"name": "compile-probe", "dir": tempfile.mkdtemp(prefix="d9d-compile-probe-")},
            "batching": {"global_batch_size": 2, "microbatch_size": 2},
            "trainer": {"total_steps": args.steps},
            "logging": {"progress_bar": "off", "period": 1000},
            "checkpointing": {"save_at_end": False},
            "gradient_clipping": {"max_norm": None},
            "model": {
                "provider": "qwen3_moe" if args.model == "moe" else "qwen3",
                "options": {"architecture": arch, "dtype": "bfloat16"},
            },
            "data": {"provider": "throughput.d9d_peer:BenchBatches", "options": {"kind": "random"}},
            "optimizer": {"provider": "adamw", "options": {"lr": 1e-4, "weight_decay": 0.0}},
            "compile": {"enabled": True},
        }
    )
    ctx = DistributedContext.create(DeviceMeshParameters())
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 1))
    trainer.setup()
    trainer.train()
    from torch._dynamo.utils import counters

    print("dynamo stats:", dict(counters["stats"]), "graph breaks:", dict(counters["graph_break"]))


if __name__ == "__main__":
    main()
