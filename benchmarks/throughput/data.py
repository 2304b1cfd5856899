"""A data provider for throughput jobs run through the engine: random tokens of the benchmark's shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field


class RandomTokens:
    """Uniform random token ids, fresh every step (the data position is not part of what is measured).

    Each data-parallel rank draws its own stream (seeded by its dp rank; ranks that share one, such as the
    tensor- or context-parallel ranks of a replica, draw the same batches). `probe_dir`: install the per-rank
    timing probe of `throughput.probe` in this process, writing there; `profile_from` (with `probe_dir`):
    the probe also profiles `profile_steps` steps from that step on (`probe.ProfileWindow`), and with
    `profile_trace` rank 0 exports its Chrome trace.
    """

    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        vocab_size: int = Field(ge=2)
        seq_len: int = Field(ge=1)
        probe_dir: str | None = None
        profile_from: int | None = Field(None, ge=2)  # step 1 compiles; the step before is the warm-up
        profile_steps: int = Field(3, ge=1)
        profile_trace: bool = False

    def __init__(self, config: Config) -> None:
        self.config = config
        self.generator = torch.Generator().manual_seed(0)
        self.probe: Any = None

    def setup(self, setup: Any) -> None:
        self.s = setup
        self.generator.manual_seed(setup.dp_rank)
        if self.config.probe_dir is not None:
            from throughput import probe

            c = self.config
            window = None
            if c.profile_from is not None:
                window = probe.ProfileWindow(c.profile_from, c.profile_steps, c.profile_trace)
            self.probe = probe.install(Path(c.probe_dir), window)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        if self.probe is not None:
            self.probe.step_started()
        batches = []
        for _ in range(self.s.gradient_accumulation):
            shape = (self.s.microbatch_size, self.config.seq_len + 1)
            ids = torch.randint(0, self.config.vocab_size, shape, generator=self.generator)
            batches.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
        return batches

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        return None
