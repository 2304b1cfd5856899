"""An instruction-tuning data provider: prompt/response pairs from a jsonl file, trained on the response only.

Each pair becomes one byte-tokenized document, `<bos>User: {prompt}\\nAssistant: {response}<eos>`. Labels
are the next token within the document (the built-in `causal_lm` task's convention) and -100 wherever
that next token still belongs to the prompt, so the loss and the gradients come from the responses alone.

The pairs are dealt to data-parallel ranks by `d9d.data.ShardedDataset`, whose cursor is the provider's
checkpointed state: a resumed (or resized) run continues with the next unread pair.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from d9d.data import IGNORE_INDEX, ByteTokenizer, ShardedDataset, pad_stack
from d9d.engine.providers import DataSetup

TEMPLATE = "User: {prompt}\nAssistant: "


def encode_pair(tokenizer: ByteTokenizer, prompt: str, response: str) -> dict[str, torch.Tensor]:
    prompt_ids = [tokenizer.bos_id, *tokenizer.encode(TEMPLATE.format(prompt=prompt))]
    ids = [*prompt_ids, *tokenizer.encode(response), tokenizer.eos_id]
    labels = [*ids[1:], IGNORE_INDEX]
    for t in range(len(prompt_ids) - 1):  # position t predicts ids[t + 1]: still the prompt
        labels[t] = IGNORE_INDEX
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}


def read_pairs(path: Path) -> list[tuple[str, str]]:
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("response"), str):
            raise ValueError(f"{path}:{number}: needs string fields 'prompt' and 'response'")
        pairs.append((row["prompt"], row["response"]))
    if not pairs:
        raise ValueError(f"{path} holds no prompt/response pairs")
    return pairs


class InstructionData:
    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

        path: Path  # jsonl, one {"prompt": ..., "response": ...} per line

    def __init__(self, config: Config) -> None:
        tokenizer = ByteTokenizer()
        self.pad_id = tokenizer.pad_id
        self.samples = [encode_pair(tokenizer, p, r) for p, r in read_pairs(config.path)]

    def setup(self, setup: DataSetup) -> None:
        self.setup_info = setup
        # Repeat the pairs for as many steps as training runs; every rank reads the same number per step.
        self.sharded = ShardedDataset(
            self.samples,
            num_shards=setup.dp_size,
            shard_index=setup.dp_rank,
            uneven="drop",
            epochs=None,
            on_reshard="keep_position",
        )
        self.stream = iter(self.sharded)

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        s = self.setup_info
        samples = [next(self.stream) for _ in range(s.microbatch_size * s.gradient_accumulation)]
        return [
            self.collate(samples[i : i + s.microbatch_size])
            for i in range(0, len(samples), s.microbatch_size)
        ]

    def collate(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-padded rows; padding is masked out of attention and of the loss."""
        input_ids = pad_stack([s["input_ids"] for s in samples], self.pad_id)
        lengths = torch.tensor([len(s["input_ids"]) for s in samples])
        positions = torch.arange(input_ids.shape[1])
        return {
            "input_ids": input_ids,
            "labels": pad_stack([s["labels"] for s in samples], IGNORE_INDEX),
            "position_ids": positions.expand_as(input_ids),
            "attention_mask": (positions < lengths[:, None]).long(),
        }

    def state_dict(self) -> dict[str, Any]:
        return self.sharded.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.sharded.load_state_dict(state)
        self.stream = iter(self.sharded)
