"""Small user-style providers for engine tests: referenced from configs by import path."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from d9d.engine.providers import LossOutput


class _Opts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WidthModelProvider:
    class Config(_Opts):
        width: int = Field(8, ge=1)

    def __init__(self, config: Config) -> None:
        self.config = config


class NotAProvider:
    pass


# -- a tiny user-style LM setup, for engine loop tests that must not depend on the model catalogue ------

VOCAB = 32
SEQ = 8


class TinyLM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, VOCAB)

    def reset_parameters(self) -> None:
        for m in (self.embed, self.hidden, self.head):
            m.reset_parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(input_ids))))


class TinyLMProvider:
    class Config(_Opts):
        width: int = Field(16, ge=1)

    def __init__(self, config: Config) -> None:
        self.config = config

    def build_stage(self, stage):
        return TinyLM(self.config.width)

    def parallelize(self, module, ctx) -> None:
        from d9d.parallel import parallelize_replicate

        if ctx.params.data_parallel > 1:
            parallelize_replicate(module, ctx.mesh_for("batch")["dp"])

    def initialize(self, module, ctx) -> None:
        module.reset_parameters()  # the engine has seeded the parameter RNG for this stage

    def export(self, modules, ctx, path) -> None:
        return None

    def subscribe(self, events, modules, ctx, metrics) -> None:
        return None  # no step logic of its own


def sample_tokens(index: int) -> torch.Tensor:
    """Global sample `index` of an infinite deterministic stream (a noisy counting pattern)."""
    g = torch.Generator().manual_seed(1000 + index)
    start = int(torch.randint(0, VOCAB, (1,), generator=g))
    noise = (torch.rand(SEQ + 1, generator=g) < 0.1).long()
    return (start + torch.arange(SEQ + 1) + noise) % VOCAB


class GlobalIndexData:
    """Step s uses global samples [s*G, (s+1)*G); DP rank d takes its contiguous slice, so any DP degree
    sees the same global batch."""

    class Config(_Opts):
        pass

    def __init__(self, config: Config) -> None:
        self.step = 0

    def setup(self, setup) -> None:
        self.s = setup

    def next_step(self):
        s = self.s
        per_rank = s.global_batch_size // s.dp_size
        base = self.step * s.global_batch_size + s.dp_rank * per_rank
        self.step += 1
        samples = torch.stack([sample_tokens(base + i) for i in range(per_rank)])
        return [
            {"input_ids": chunk[:, :-1], "labels": chunk[:, 1:]} for chunk in samples.split(s.microbatch_size)
        ]

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state) -> None:
        self.step = int(state["step"])


class StallingData(GlobalIndexData):
    """`GlobalIndexData` whose step `stall_at` never reaches its boundary: fetching its data writes the file
    `marker` and sleeps an hour on the training thread (for what a signal does meanwhile)."""

    class Config(_Opts):
        stall_at: int = Field(ge=1)
        marker: str

    def __init__(self, config: Config) -> None:
        super().__init__(GlobalIndexData.Config())
        self.config = config

    def next_step(self):
        import time
        from pathlib import Path

        if self.step + 1 == self.config.stall_at:
            Path(self.config.marker).write_text(str(self.config.stall_at))
            time.sleep(3600)
        return super().next_step()


class TokenCETask:
    class Config(_Opts):
        track_accuracy: bool = False

    def __init__(self, config: Config) -> None:
        self.config = config

    def forward_inputs(self, microbatch):
        return {"input_ids": microbatch["input_ids"]}

    def compute_loss(self, outputs, microbatch):
        labels = microbatch["labels"]
        loss = nn.functional.cross_entropy(outputs.flatten(0, 1), labels.flatten(), reduction="sum")
        return LossOutput(loss, torch.tensor(float(labels.numel())))

    def create_metrics(self):
        from d9d.metrics import MeanMetric

        return {"accuracy": MeanMetric()} if self.config.track_accuracy else {}

    def update_metrics(self, metrics, outputs, microbatch, loss) -> None:
        if metrics:
            metrics["accuracy"].update((outputs.argmax(-1) == microbatch["labels"]).float())


class FiniteTokens:
    """`num_samples` deterministic sequences (`sample_tokens`), split over DP ranks, then exhausted."""

    class Config(_Opts):
        num_samples: int = Field(10, ge=1)

    def __init__(self, config: Config) -> None:
        self.config = config
        self.position = 0

    def setup(self, setup) -> None:
        self.s = setup
        mine = range(setup.dp_rank, self.config.num_samples, setup.dp_size)
        self.samples = list(mine)

    def next_step(self):
        if self.position >= len(self.samples):
            return []
        ids = self.samples[self.position : self.position + self.s.microbatch_size]
        self.position += len(ids)
        batch = torch.stack([sample_tokens(i) for i in ids])
        return [{"input_ids": batch[:, :-1], "labels": batch[:, 1:]}]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state) -> None:
        self.position = int(state["position"])


def make_hf_qwen3(path, num_layers: int = 2, vocab_size: int = VOCAB):
    """A tiny random transformers Qwen3 saved at `path` (vocab 32 matches the token fixtures; 259 the byte
    tokenizer of the built-in text provider)."""
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a launcher subprocess: the repo importable, the caller's PYTHONPATH kept."""
    import os

    path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def torchrun_command(job, *overrides: str, nproc: int = 2) -> list[str]:
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["-m", "d9d.engine.launch", str(job)]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def jsonl_losses(run_dir) -> list[float]:
    """Per-step losses from the default tracker's metrics.jsonl in a run directory."""
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        r["values"]["train/loss"] for r in records if r["event"] == "scalars" and "train/loss" in r["values"]
    ]


def make_hf_qwen3_moe(path, num_layers: int = 4, vocab_size: int = VOCAB, mlp_only_layers=()):
    """A tiny random transformers Qwen3-MoE (4 experts, top 2) saved at `path`; `mlp_only_layers` have a
    plain MLP instead of experts."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        mlp_only_layers=list(mlp_only_layers),
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    model.save_pretrained(path)
    return model
