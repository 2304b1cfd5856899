"""Training throughput of the d9d engine vs Hugging Face transformers, same process, same shapes.

    python benchmarks/train_throughput.py [--model dense|moe|both] [--steps 10] [--warmup 3] [--out FILE]

Both sides train a randomly initialized model in bf16 with fused AdamW on batch 8 x 2048 random tokens:
transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` in a plain loop, and d9d's Qwen3 / Qwen3-MoE through
the real engine (`d9d.engine.Trainer`: data provider, task, gradient reducer, clipping off, optimizer). The
shapes are the mission's anchors: Qwen3-0.6B (28 layers, hidden 1024, 16/8 heads, head_dim 128, ffn 3072,
vocab 151936) and a small Qwen3-MoE (16 layers, 64 experts top-8, moe ffn 512). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

BATCH, SEQ = 8, 2048
COMMON = {"vocab_size": 151936, "hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128}
DENSE = {**COMMON, "num_layers": 28, "num_kv_heads": 8, "intermediate_size": 3072}
MOE = {
    **COMMON,
    "num_layers": 16,
    "num_kv_heads": 4,
    "intermediate_size": 3072,
    "moe_intermediate_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 8,
}
PEAK_TFLOPS = 989.0  # H100 SXM dense bf16 spec; the mission measured ~784 for plain matmuls


class RandomTokens:
    """Fresh uniform random tokens every step (the benchmark measures compute, not data)."""

    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

    def __init__(self, config: Config) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def setup(self, setup: Any) -> None:
        self.s = setup

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        out = []
        for _ in range(self.s.gradient_accumulation):
            ids = torch.randint(
                0, COMMON["vocab_size"], (self.s.microbatch_size, SEQ + 1), generator=self.generator
            )
            out.append({"input_ids": ids[:, :-1].cuda(), "labels": ids[:, 1:].cuda()})
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        return None


def flops_per_token(arch: dict[str, Any], moe: bool) -> float:
    """6 × active parameters per token + causal attention (PaLM-style accounting)."""
    h, layers = arch["hidden_size"], arch["num_layers"]
    q = arch["num_attention_heads"] * arch["head_dim"]
    kv = arch["num_kv_heads"] * arch["head_dim"]
    attn = h * (q + 2 * kv) + q * h
    ffn = (
        3
        * h
        * (arch["moe_intermediate_size"] * arch["num_experts_per_tok"] if moe else arch["intermediate_size"])
    )
    router = h * arch["num_experts"] if moe else 0
    active = layers * (attn + ffn + router) + arch["vocab_size"] * h  # lm head (embedding lookup is free)
    return 6.0 * active + 6.0 * layers * q * SEQ  # causal: half of 12·L·q·T


def _summary(name: str, times: list[float], arch: dict[str, Any], moe: bool) -> dict[str, Any]:
    step = sorted(times)[len(times) // 2]
    tps = BATCH * SEQ / step
    return {
        "name": name,
        "median_step_s": step,
        "tokens_per_s": tps,
        "mfu_vs_989": tps * flops_per_token(arch, moe) / (PEAK_TFLOPS * 1e12),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def run_hf(arch: dict[str, Any], moe: bool, steps: int, warmup: int) -> dict[str, Any]:
    import transformers

    common = {
        "vocab_size": arch["vocab_size"],
        "hidden_size": arch["hidden_size"],
        "num_hidden_layers": arch["num_layers"],
        "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_kv_heads"],
        "head_dim": arch["head_dim"],
        "intermediate_size": arch["intermediate_size"],
        "tie_word_embeddings": False,
        "max_position_embeddings": SEQ,
    }
    torch.manual_seed(0)
    if moe:
        config = transformers.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=arch["moe_intermediate_size"],
            num_experts=arch["num_experts"],
            num_experts_per_tok=arch["num_experts_per_tok"],
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    model = model.to(device="cuda", dtype=torch.bfloat16).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for i in range(warmup + steps):
        ids = torch.randint(0, arch["vocab_size"], (BATCH, SEQ + 1), generator=g).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(input_ids=ids[:, :-1], labels=ids[:, :-1])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.loss.item()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    result = _summary(f"transformers {'Qwen3-MoE' if moe else 'Qwen3-0.6B'}", times, arch, moe)
    del model, optimizer
    torch.cuda.empty_cache()
    return result


def run_d9d(arch: dict[str, Any], moe: bool, steps: int, warmup: int) -> dict[str, Any]:
    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.config import parse_config
    from d9d.engine.events import StepFinished, StepStarted
    from d9d.engine.trainer import Trainer

    config = parse_config(
        {
            "run": {"name": "bench", "dir": "/tmp/d9d-bench"},
            "batching": {"global_batch_size": BATCH, "microbatch_size": BATCH},
            "trainer": {"total_steps": warmup + steps},
            "logging": {"progress_bar": "off", "period": 1000},
            "checkpointing": {"save_at_end": False},
            "gradient_clipping": {"max_norm": None},
            "model": {
                "provider": "qwen3_moe" if moe else "qwen3",
                "options": {"architecture": {**arch, "max_position_embeddings": SEQ}, "dtype": "bfloat16"},
            },
            "data": {"provider": "__main__:RandomTokens"},
            "optimizer": {"provider": "adamw", "options": {"lr": 1e-4, "weight_decay": 0.0}},
        }
    )
    ctx = DistributedContext.create(DeviceMeshParameters())
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 1))
    starts: dict[int, float] = {}
    times: list[float] = []

    def on_start(event: StepStarted) -> None:
        torch.cuda.synchronize()
        starts[event.step] = time.perf_counter()

    def on_finish(event: StepFinished) -> None:  # the loss is already a host float: the step is done
        if event.step > warmup:
            times.append(time.perf_counter() - starts[event.step])

    trainer.events.subscribe(StepStarted, on_start)
    trainer.events.subscribe(StepFinished, on_finish)
    trainer.setup()
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result = _summary(f"d9d {'Qwen3-MoE' if moe else 'Qwen3-0.6B'}", times, arch, moe)
    del trainer
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["dense", "moe", "both"], default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    results = []
    for moe in {"dense": [False], "moe": [True], "both": [False, True]}[args.model]:
        arch = MOE if moe else DENSE
        hf = run_hf(arch, moe, args.steps, args.warmup)
        ours = run_d9d(arch, moe, args.steps, args.warmup)
        ours["ratio_vs_transformers"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        results += [hf, ours]
        for r in (hf, ours):
            print(json.dumps(r), flush=True)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
