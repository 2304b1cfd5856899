"""A data provider for throughput jobs run through the engine: random tokens of the benchmark's shape."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field


class RandomTokens:
    """Uniform random token ids, fresh every step (the data position is not part of what is measured)."""

    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        vocab_size: int = Field(ge=2)
        seq_len: int = Field(ge=1)

    def __init__(self, config: Config) -> None:
        self.config = config
        self.generator = torch.Generator().manual_seed(0)

    def setup(self, setup: Any) -> None:
        self.s = setup

    def next_step(self) -> list[dict[str, torch.Tensor]]:
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
