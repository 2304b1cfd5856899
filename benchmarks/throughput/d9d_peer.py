"""d9d rows: the real engine (`d9d.engine.Trainer`: data provider, task, gradient reducer, clipping off,
fused AdamW) on the batches a run would feed it.

Variants (the job's `compile:` section): `compiled` = `{enabled: true}`, `compiled-kernels` = the same with
the model's `kernel_backend: triton` (the fused Triton kernels inside the compiled regions instead of
inductor's fusion of the reference ops), `compiled-autotune` = `{enabled: true, mode:
max-autotune-no-cudagraphs}` (inductor times Triton matmul templates, with their fused epilogues, against
cuBLAS per shape), `eager` = `{enabled: false}`, `eager-legacy` = no section at all, for an engine that
predates the field (a command-line choice; the script never probes which engine it has).

`compiled-a2a` (MoE model): the `compiled` row with every MoE layer's experts reached through expert
parallelism's all-to-all exchange over a group of this one rank, as at ep >= 2 but with the transfers local
copies: each layer reads its split sizes on the host and runs the exchange's eager index work
(`AllToAllMoECommunication`), so the step pays the host cost of the multi-GPU step's exchange on one GPU.
`compiled-a2a-static`: the same exchange with a static capacity of exactly the batch's copies (on one rank
every copy stays here, so nothing pads or overflows): the same eager work and compiled pieces without the
host read of the split sizes — what separates the cost of the read from the cost of the host's work.
`compiled-breaks`: the local experts' own dispatch and combine (one permute, one combine) run eagerly
between compiled pieces, as the exchange does: each MoE layer in the same five compiled pieces as under
`compiled-a2a`, without the exchange's extra work — what separates the cost of splitting the layer from
the cost of the exchange.

`ac` (`common.AC_MODES`) sets the job's `activation_checkpointing:` section (`common.d9d_ac_section`).

Batches:
- `random`: bare causal random tokens, no mask, no positions (what the benchmark measured before).
- `collate`: the built-in text provider (`data.provider: text`) end to end on a generated text file whose
  lines fill the 2048 window: byte tokenizer, `CausalLMCollator`, the provider's key rules.
- `padded`: the same provider on lines of 1024–2048 bytes (one full line per batch fixes the width), so
  rows are right-padded and an `attention_mask` is present. Tokens/s counts every position, padding
  (about a fifth here) included, like every other row.
- `ones-mask`: random tokens plus an all-ones `attention_mask` (what every collated batch carried while the
  provider passed the mask unconditionally).
- `packed`: documents of mean 512 tokens (uniform 1..1023) packed into 2048-token rows by
  `CausalLMCollator(pack_length=2048)`; the row's last document is cut to fill the window (a stream cut
  into windows). The collator's `segment_ids` (packed rows carry them) keep attention inside each
  document.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from throughput import profile as gpu_profile
from throughput.common import (
    ARCHS,
    BATCH,
    COMMON,
    LLAMA3_ROPE,
    LR,
    PROFILE_STEPS,
    PROVIDERS,
    SEQ,
    AcMode,
    StepMarks,
    d9d_ac_section,
    summary,
)

D9dVariant = Literal[
    "compiled",
    "compiled-kernels",
    "compiled-autotune",
    "compiled-a2a",
    "compiled-a2a-static",
    "compiled-breaks",
    "eager",
    "eager-legacy",
]
D9dBatch = Literal["random", "collate", "padded", "ones-mask", "packed"]
MEAN_DOC = 512


class BenchBatches:
    """Synthetic batches for the engine (kinds `random`, `ones-mask`, `packed`), fresh every step."""

    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        kind: Literal["random", "ones-mask", "packed"] = "random"
        vocab_size: int = COMMON["vocab_size"]

    def __init__(self, config: Config) -> None:
        self.kind = config.kind
        self.vocab_size = config.vocab_size
        self.generator = torch.Generator().manual_seed(0)
        self.lengths = random.Random(0)

    def setup(self, setup: Any) -> None:
        self.s = setup

    def _tokens(self, *shape: int) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, shape, generator=self.generator)

    def _packed_row(self) -> dict[str, torch.Tensor]:
        from d9d.data import CausalLMCollator

        docs, used = [], 0
        while used < SEQ:
            n = min(self.lengths.randint(1, 2 * MEAN_DOC - 1), SEQ - used)
            docs.append({"input_ids": self._tokens(n)})
            used += n
        return CausalLMCollator(pad_id=0, pack_length=SEQ)(docs)

    def _microbatch(self) -> dict[str, torch.Tensor]:
        b = self.s.microbatch_size
        match self.kind:
            case "random":
                ids = self._tokens(b, SEQ + 1)
                return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
            case "ones-mask":
                ids = self._tokens(b, SEQ + 1)
                mask = torch.ones(b, SEQ, dtype=torch.long)
                return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "attention_mask": mask}
            case "packed":
                rows = [self._packed_row() for _ in range(b)]
                batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
                # Rows are full (no padding), so the provider's rule drops the all-ones attention_mask.
                return {
                    "input_ids": batch["input_ids"],
                    "labels": batch["labels"],
                    "position_ids": batch["position_ids"],
                    "segment_ids": batch["segment_ids"],
                }

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        return [self._microbatch() for _ in range(self.s.gradient_accumulation)]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        return None


def _text_file(kind: Literal["collate", "padded"], lines: int) -> Path:
    """Random lowercase text, one document per line; every `BATCH`-th line is full length so each padded
    batch is exactly `SEQ` wide."""
    rng = random.Random(0)
    path = Path(tempfile.mkdtemp(prefix="d9d-bench-")) / f"{kind}.txt"
    with path.open("w") as f:
        for i in range(lines):
            full = kind == "collate" or i % BATCH == 0
            n = SEQ + 16 if full else rng.randint(SEQ // 2, SEQ - 3)
            f.write("".join(rng.choices("abcdefghijklmnopqrstuvwxyz ", k=n)) + "\n")
    return path


def data_section(batch: D9dBatch, total_steps: int, vocab_size: int = COMMON["vocab_size"]) -> dict[str, Any]:
    match batch:
        case "collate" | "padded":
            path = _text_file(batch, total_steps * BATCH)
            return {
                "provider": "text",
                "options": {"dataset": {"paths": [str(path)], "max_length": SEQ}, "pad_to_multiple_of": 8},
            }
        case "random" | "ones-mask" | "packed":
            options = {"kind": batch, "vocab_size": vocab_size}
            return {"provider": "throughput.d9d_peer:BenchBatches", "options": options}


def _rope(model: str) -> dict[str, Any]:
    if model != "llama3":
        return {}
    theta, scaling = LLAMA3_ROPE["rope_theta"], {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    return {"rope_theta": theta, "rope_scaling": {"kind": "llama3", **scaling}}


def compile_section(variant: D9dVariant) -> dict[str, Any]:
    match variant:
        case "compiled" | "compiled-kernels" | "compiled-a2a" | "compiled-a2a-static" | "compiled-breaks":
            return {"compile": {"enabled": True}}
        case "compiled-autotune":
            return {"compile": {"enabled": True, "mode": "max-autotune-no-cudagraphs"}}
        case "eager":
            return {"compile": {"enabled": False}}
        case "eager-legacy":
            return {}


def job(
    model: str,
    variant: D9dVariant,
    batch: D9dBatch,
    total: int,
    ac: AcMode = "none",
    arch_overrides: dict[str, Any] | None = None,
    *,
    run_dir: str,
) -> dict[str, Any]:
    """The job config of a d9d row (`total` steps), its run files under `run_dir` (the caller's to remove)."""
    return {
        "run": {"name": "bench", "dir": run_dir},
        "batching": {"global_batch_size": BATCH, "microbatch_size": BATCH},
        "trainer": {"total_steps": total},
        "logging": {"progress_bar": "off", "period": 1000},
        "checkpointing": {"save_at_end": False},
        "gradient_clipping": {"max_norm": None},
        "model": {
            "provider": PROVIDERS[model],
            "options": {
                "architecture": {
                    **ARCHS[model],
                    **_rope(model),
                    "max_position_embeddings": SEQ,
                    # compiled regions take the Triton kernels instead of letting inductor fuse the
                    # reference ops
                    **({"kernel_backend": "triton"} if variant == "compiled-kernels" else {}),
                    **(arch_overrides or {}),
                },
                "dtype": "bfloat16",
            },
        },
        "data": data_section(batch, total, ARCHS[model]["vocab_size"]),
        "optimizer": {"provider": "adamw", "options": {"lr": LR, "weight_decay": 0.0}},
        **compile_section(variant),
        **({} if ac == "none" else {"activation_checkpointing": d9d_ac_section(ac)}),
    }


def _exchange_on_one_rank(modules: list[torch.nn.Module], tokens: int | None = None) -> None:
    """Every MoE layer's experts behind the all-to-all exchange over this one rank (its transfers local
    copies, its host reads of split sizes real), before the first forward compiles the blocks. With `tokens`
    (per microbatch) each exchange gets a static capacity of exactly tokens × top-k rows: no host read."""
    import torch.distributed as dist

    from d9d.modules.moe import MoELayer
    from d9d.parallel.expert import AllToAllMoECommunication, ExchangeCapacity

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group([0])
    layers = [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError("the compiled-a2a variant needs an MoE model (--model moe)")
    for layer in layers:
        capacity = None
        if tokens is not None:
            capacity = ExchangeCapacity(1.0, rank=0, peers=1, align=1)
            capacity.set_rows([[tokens * layer.gate.top_k]])
        layer.communication = AllToAllMoECommunication(group, capacity=capacity)


def _local_with_breaks(modules: list[torch.nn.Module]) -> None:
    """Every MoE layer's local dispatch and combine run eagerly (graph breaks where the exchange has them),
    before the first forward compiles the blocks."""
    from d9d.modules.moe import LocalMoECommunication, MoELayer
    from d9d.modules.moe.communication import DispatchedTokens, RoutedTokens

    class EagerLocal(LocalMoECommunication):
        @torch.compiler.disable  # type: ignore[untyped-decorator]
        def dispatch(self, routed: RoutedTokens) -> DispatchedTokens:
            return super().dispatch(routed)

        @torch.compiler.disable  # type: ignore[untyped-decorator]
        def combine(self, expert_outputs: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
            return super().combine(expert_outputs, dispatched)

    layers = [m for module in modules for m in module.modules() if isinstance(m, MoELayer)]
    if not layers or not all(isinstance(m.communication, LocalMoECommunication) for m in layers):
        raise ValueError("the compiled-breaks variant needs an MoE model with local experts (--model moe)")
    for layer in layers:
        local = layer.communication
        assert isinstance(local, LocalMoECommunication)
        layer.communication = EagerLocal(align=local.align, backend=local.backend)


def run(
    model: str,
    variant: D9dVariant,
    batch: D9dBatch,
    steps: int,
    warmup: int,
    profile: bool,
    profile_ops: bool = False,
    arch_overrides: dict[str, Any] | None = None,
    ac: AcMode = "none",
) -> dict[str, Any]:
    """One d9d row in this process; its run files in a temporary directory, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="d9d-bench-run-", ignore_cleanup_errors=True) as run_dir:
        from d9d.core import DeviceMeshParameters, DistributedContext
        from d9d.engine.checkpoint import LocalRunReporter
        from d9d.engine.config import parse_config
        from d9d.engine.events import StepStarted
        from d9d.engine.trainer import Trainer

        profiled = PROFILE_STEPS if profile else 0
        first_profiled = warmup + steps + 1
        # One step more than timed and profiled: each step ends where the next one starts.
        total = warmup + steps + profiled + 1
        config = parse_config(job(model, variant, batch, total, ac, arch_overrides, run_dir=run_dir))
        ctx = DistributedContext.create(DeviceMeshParameters())
        trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 1))
        # GPU activity only: host-side op recording would slow the launches and inflate the idle gaps.
        # (`profile_ops` records host ops too, to name the ATen op and shapes behind each kernel.)
        activities = [torch.profiler.ProfilerActivity.CUDA]
        if profile_ops:
            activities.append(torch.profiler.ProfilerActivity.CPU)
        prof = torch.profiler.profile(
            activities=activities, record_shapes=profile_ops, with_stack=profile_ops
        )

        def profile_window(step: int) -> None:  # between two timed steps: the profiler's own cost is outside
            if profiled and step == first_profiled + profiled:
                prof.stop()
            if profiled and step == first_profiled:
                prof.start()

        marks = StepMarks(torch.cuda.is_available(), between=profile_window)
        trainer.events.subscribe(StepStarted, marks)
        setup_start = time.perf_counter()
        trainer.setup()
        if variant in ("compiled-a2a", "compiled-a2a-static"):
            _exchange_on_one_rank(trainer.modules, BATCH * SEQ if variant == "compiled-a2a-static" else None)
        if variant == "compiled-breaks":
            _local_with_breaks(trainer.modules)
        setup_s = time.perf_counter() - setup_start
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        durations = marks.durations()
        times = [durations[s] for s in range(warmup + 1, warmup + steps + 1)]
        result = summary(times, durations.get(1), model)
        result["setup_s"] = setup_s
        if profiled:
            wall = sum(durations[s] for s in range(first_profiled, first_profiled + profiled))
            report = gpu_profile.breakdown(prof, wall, profiled)
            result["profile"] = report
            print(gpu_profile.render(report), flush=True)
            if profile_ops:
                table = prof.key_averages(group_by_input_shape=True).table(
                    sort_by="self_device_time_total",
                    row_limit=30,
                    max_name_column_width=50,
                    max_shapes_column_width=70,
                )
                print(table, flush=True)
                stacks = prof.key_averages(group_by_stack_n=6).table(
                    sort_by="self_device_time_total", row_limit=12, max_name_column_width=40
                )
                print(stacks, flush=True)
        return result
