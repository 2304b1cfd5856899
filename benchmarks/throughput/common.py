"""Shapes, FLOP accounting and the timing loop shared by every row."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

# The shape every row trains on: batch 8 × 2048 unless the parent sets `--batch` / `--seq`, which reach the
# row's subprocess through these variables (read here, before any peer module imports the values).
BATCH = int(os.environ.get("D9D_BENCH_BATCH", "8"))
SEQ = int(os.environ.get("D9D_BENCH_SEQ", "2048"))
# Activation checkpointing of a row, named alike for d9d and torchtitan: `selective` recomputes every second
# layer (torchtitan's `selective_ac_option: "2"`, d9d's `every: 2`), `selective-op` keeps the matmul and
# attention outputs of every layer and recomputes the rest (torchtitan's `"op"`, d9d's `ops`), `selective-mix`
# recomputes every second layer whole and the others op-level (d9d's `every: 2` with `ops`; torchtitan has no
# such option, so its rows take `TITAN_AC_MODES` only).
AcMode = Literal["none", "full", "selective", "selective-op", "selective-mix"]
AC_MODES: tuple[AcMode, ...] = ("none", "full", "selective", "selective-op", "selective-mix")
TITAN_AC_MODES: tuple[AcMode, ...] = ("none", "full", "selective", "selective-op")


def one_rank_env() -> None:
    """Describe a one-rank process group as torchrun would (rank 0 of 1, a free port on 127.0.0.1), for a
    script that drives the engine's `Trainer` in its own process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )


class StepMarks:
    """Times d9d steps from one step's start to the next's, the device synchronized at each, as `time_loop`
    times the peers' steps: all of a step's GPU work counts, the optimizer kernels the engine queues after
    reading the step's loss included (timing to that read left them out, ~5 ms of the dense step).

    Subscribe it to the engine's `StepStarted` (`trainer.events.subscribe(StepStarted, marks)`); `mark(n)`
    closes step n - 1 where no step n starts (e.g. on `TrainingFinished`). `between(step)`, when given,
    runs between step - 1's end and step's start, outside both (a profiler's start and stop)."""

    def __init__(
        self,
        cuda: bool = True,
        between: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cuda = cuda
        self.between = between
        self.clock = clock
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}

    def __call__(self, event: Any) -> None:
        self.mark(event.step)

    def mark(self, step: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.ends[step - 1] = self.clock()
        if self.between is not None:
            self.between(step)
        self.starts[step] = self.clock()

    def durations(self) -> dict[int, float]:
        """Seconds of each step that both started and ended."""
        return {step: self.ends[step] - start for step, start in self.starts.items() if step in self.ends}


def d9d_ac_section(ac: AcMode) -> dict[str, Any]:
    """The d9d job's `activation_checkpointing:` section for a row's mode."""
    match ac:
        case "none":
            return {"mode": "none"}
        case "full":
            return {"mode": "full"}
        case "selective":
            return {"mode": "selective", "every": 2}
        case "selective-op":
            return {"mode": "selective", "ops": ["matmul", "attention"]}
        case "selective-mix":
            return {"mode": "selective", "every": 2, "ops": ["matmul", "attention"]}


COMMON = {"vocab_size": 151936, "hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128}
# Qwen3-0.6B, untied LM head.
DENSE = {**COMMON, "num_layers": 28, "num_kv_heads": 8, "intermediate_size": 3072}
# A small Qwen3-MoE: every layer sparse.
MOE = {
    **COMMON,
    "num_layers": 16,
    "num_kv_heads": 4,
    "intermediate_size": 3072,
    "moe_intermediate_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 8,
}
# Llama-3.2-1B's shape (16 layers, hidden 2048, 32/8 heads of 64, ffn 8192, vocab 128256, Llama 3.1 RoPE
# scaling), untied in every row: torchtitan's llama3 cannot tie, and the head's FLOPs are the same either way.
LLAMA3 = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "head_dim": 64,
    "num_layers": 16,
    "num_kv_heads": 8,
    "intermediate_size": 8192,
}
LLAMA3_ROPE = {
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# A small DeepSeek-V3 of the MoE row's size: the MoE row's vocabulary (so the LM head and loss, a large
# share of a step this small, cost what they cost there), hidden size, depth, heads and expert grid, with
# DeepSeek-V3's own parts: multi-head latent attention (no query low-rank, as in DeepSeek-V2-Lite and
# torchtitan's 16B entry; kv latent 512, 128 + 64 rotary query/key dims, values of 128), the first layer
# dense (ffn 3072), one shared expert beside the routed ones, sigmoid scores limited to the 4 best of 8
# expert groups (both frameworks rank a group by the sum of its two best scores), top-k weights
# renormalized and scaled by DeepSeek-V3's 2.5. Plain RoPE (theta 10000, interleaved pairs as torchtitan
# rotates them): torchtitan applies YaRN only past its `original_seq_len` of 4096, and this row runs 2048.
# No aux-loss-free expert bias on either side: the torchtitan row's loop does not run its trainer's
# optimizer hook that updates the bias, so d9d's row keeps none either (the routing is then the same
# function of the scores in both).
DEEPSEEK_V3 = {
    "vocab_size": COMMON["vocab_size"],
    "hidden_size": 1024,
    "num_layers": 16,
    "first_k_dense": 1,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "moe_intermediate_size": 512,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "num_expert_groups": 8,
    "topk_groups": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "expert_bias": False,
    "rope_theta": 10000.0,
}
ARCHS = {"dense": DENSE, "moe": MOE, "llama3": LLAMA3, "deepseek_v3": DEEPSEEK_V3}
# the d9d provider (model family) of each shape
PROVIDERS = {"dense": "qwen3", "moe": "qwen3_moe", "llama3": "llama3", "deepseek_v3": "deepseek_v3"}
# A Qwen3 small enough for CPU smoke runs of the engine-driven benchmarks (no numbers are taken from it).
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "head_dim": 16,
    "num_layers": 2,
    "num_kv_heads": 2,
    "intermediate_size": 128,
}
TINY_BATCH, TINY_SEQ = 2, 32
# The multi-GPU benchmark's CPU smoke shapes: 6 layers, so a pipeline of 2 ranks × 2 stages (ZBV, DualPipeV)
# has a layer on every stage (the embedding and the head count as one layer each when stages are balanced);
# the MoE one has 4 experts (expert parallel 2 splits them).
SMOKE_ARCHS = {
    "dense": {**TINY, "num_layers": 6},
    "moe": {**TINY, "num_layers": 6, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
}
MODEL_NAMES = {
    "dense": "Qwen3-0.6B",
    "moe": "Qwen3-MoE (16L, 64e top-8)",
    "llama3": "Llama-3.2-1B (untied)",
    "deepseek_v3": "DeepSeek-V3 (16L, MLA, 64e top-8 + 1 shared)",
}
PEAK_TFLOPS = 989.0  # H100 SXM dense bf16 spec; the mission measured ~784 for plain matmuls
LR = 1e-4


def flops_per_token(arch: dict[str, Any], moe: bool, seq: int = SEQ) -> float:
    """6 × active parameters per token + causal attention at sequence length `seq` (PaLM-style accounting)."""
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
    return 6.0 * active + 6.0 * layers * q * seq  # causal: half of 12·L·q·T


def deepseek_v3_params(arch: dict[str, Any]) -> dict[str, int]:
    """Parameter counts of a DeepSeek-V3 shape from its hyper-parameters alone: `total` (every parameter:
    embedding, untied LM head, norms, all experts) and `active` (the matmul weights one token passes through:
    attention, the dense or the top-k routed + shared experts and the router, the LM head; the embedding
    lookup and the norms do no matmul)."""
    h, heads, layers = arch["hidden_size"], arch["num_attention_heads"], arch["num_layers"]
    dense, qk = arch["first_k_dense"], arch["qk_nope_head_dim"] + arch["qk_rope_head_dim"]
    q_rank, kv_rank = arch["q_lora_rank"], arch["kv_lora_rank"]
    # MLA: queries (one projection, or down + up through a normed rank), the kv latent plus the shared rotary
    # key, its up projection to every head's position-free key and value, the output projection
    query = h * heads * qk if not q_rank else q_rank * (h + heads * qk)
    attention = (
        query
        + h * (kv_rank + arch["qk_rope_head_dim"])
        + kv_rank * heads * (arch["qk_nope_head_dim"] + arch["v_head_dim"])
        + heads * arch["v_head_dim"] * h
    )
    norms = 2 * h + kv_rank + (q_rank or 0)  # the layer's two, the latent's (and the query rank's)
    expert = 3 * h * arch["moe_intermediate_size"]  # one SwiGLU expert
    router = h * arch["num_experts"]
    shared = arch["num_shared_experts"] * expert
    dense_ffn = 3 * h * arch["intermediate_size"]
    moe_layers = layers - dense
    head = arch["vocab_size"] * h
    total = (
        dense * (attention + norms + dense_ffn)
        + moe_layers * (attention + norms + arch["num_experts"] * expert + shared + router)
        + 2 * head  # embedding and untied LM head
        + h  # final norm
    )
    active = (
        dense * (attention + dense_ffn)
        + moe_layers * (attention + arch["num_experts_per_tok"] * expert + shared + router)
        + head
    )
    return {"total": total, "active": active}


def deepseek_v3_flops_per_token(arch: dict[str, Any], seq: int = SEQ) -> float:
    """6 × active parameters (`deepseek_v3_params`) + causal attention: per layer the scores are
    `heads × (qk_nope + qk_rope)` wide and the values `heads × v_head_dim`, each 2 FLOPs per multiply-add,
    × 3 for forward and backward, over T/2 keys on average (MLA expands its latent to full per-head keys and
    values before attention, so attention costs what multi-head attention of those widths costs)."""
    qk = arch["qk_nope_head_dim"] + arch["qk_rope_head_dim"]
    width = arch["num_attention_heads"] * (qk + arch["v_head_dim"])
    attention = 6.0 * width * seq / 2 * arch["num_layers"]
    return 6.0 * deepseek_v3_params(arch)["active"] + attention


def model_flops_per_token(model: str, seq: int = SEQ) -> float:
    """Training FLOPs per token of a benchmark shape (`ARCHS[model]`), by its architecture's own formula."""
    if model == "deepseek_v3":
        return deepseek_v3_flops_per_token(ARCHS[model], seq)
    return flops_per_token(ARCHS[model], model == "moe", seq)


def sync_device(device: torch.device) -> None:
    """Wait for `device`'s queued work (nothing to wait for on CPU): host timers around it see the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_ms(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Device milliseconds per call of `fn`, from CUDA events around `iters` calls queued back to back (after
    `warmup` calls)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / iters


def summary(times: list[float], first_step_s: float | None, model: str) -> dict[str, Any]:
    """Median step → tokens/s (batch × sequence positions, padding included: every row computes on all of
    them) and MFU; peak is the allocator's high-water mark since the last reset."""
    if not times:
        raise RuntimeError("no timed steps were recorded")
    step = sorted(times)[len(times) // 2]
    tps = BATCH * SEQ / step
    return {
        "median_step_s": step,
        "mean_step_s": sum(times) / len(times),  # stalled steps show here, not in the median
        "max_step_s": max(times),
        "tokens_per_s": tps,
        "mfu": tps * model_flops_per_token(model, SEQ) / (PEAK_TFLOPS * 1e12),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_step_s": first_step_s,
        "timed_steps": len(times),
    }


def random_batch(generator: torch.Generator, vocab_size: int = COMMON["vocab_size"]) -> torch.Tensor:
    """`(BATCH, SEQ + 1)` uniform random token ids on the GPU: inputs are `[:, :-1]`, targets `[:, 1:]`."""
    ids = torch.randint(0, vocab_size, (BATCH, SEQ + 1), generator=generator)
    return ids.cuda()


PROFILE_STEPS = 3
"""Steps profiled after the timed ones by `--profile`."""


def time_loop(
    step: Callable[[torch.Tensor], float],
    warmup: int,
    steps: int,
    vocab_size: int = COMMON["vocab_size"],
    profiled: int = 0,
) -> dict[str, Any]:
    """Runs `step(batch)` (which must end with a host sync, e.g. `loss.item()`) warmup + steps times on fresh
    random batches; returns the median step, MFU inputs and the first step's time (compile warm-up). With
    `profiled` > 0, that many more steps run under torch.profiler (GPU activity only, as the d9d rows'
    `--profile`) and `profile` holds their breakdown (`throughput.profile`)."""
    from throughput import profile as gpu_profile

    generator = torch.Generator().manual_seed(0)
    times: list[float] = []
    first: float | None = None
    torch.cuda.reset_peak_memory_stats()
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    profiled_wall = 0.0
    for i in range(warmup + steps + profiled):
        batch = random_batch(generator, vocab_size)
        torch.cuda.synchronize()
        if profiled and i == warmup + steps:
            prof.start()
        start = time.perf_counter()
        step(batch)
        elapsed = time.perf_counter() - start
        if i == 0:
            first = elapsed
        if warmup <= i < warmup + steps:
            times.append(elapsed)
        elif i >= warmup + steps:
            profiled_wall += elapsed
    out: dict[str, Any] = {"times": times, "first_step_s": first}
    if profiled:
        torch.cuda.synchronize()
        prof.stop()
        out["profile"] = gpu_profile.breakdown(prof, profiled_wall, profiled)
        print(gpu_profile.render(out["profile"]), flush=True)
    return out
