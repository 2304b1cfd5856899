"""Qwen3 and Qwen3-MoE causal LMs split into pipeline stages: losses and gradients equal the whole model's."""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import TypeAdapter
from torch import nn

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from d9d.models.qwen3_moe import Qwen3MoEConfig, Qwen3MoEForCausalLM
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.schedule.config import ScheduleConfig
from d9d.pipeline.setup import PipelineSetup
from tests.harness import RankEnv, run_distributed

VOCAB, SEQ, MB_SIZE = 32, 6, 2
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "num_layers": 6,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "intermediate_size": 24,
    "attention_backend": "torch",
}
CASES: list[tuple[dict[str, object], int]] = [
    ({"kind": "1f1b"}, 3),
    ({"kind": "zb1p"}, 4),
    ({"kind": "interleaved_1f1b", "stages_per_rank": 2}, 4),
    ({"kind": "zbv"}, 4),
    ({"kind": "dualpipev"}, 3),
]


def _model(moe: bool, stage: PipelineStageInfo) -> nn.Module:
    if moe:
        config = Qwen3MoEConfig(
            **COMMON, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2, grouped_mm="eager"
        )
        return Qwen3MoEForCausalLM(config, stage)
    return Qwen3ForCausalLM(Qwen3Config(**COMMON), stage)


def _batch(m: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        labels = torch.randint(0, VOCAB, (MB_SIZE, SEQ), generator=g)
        labels[torch.rand(MB_SIZE, SEQ, generator=g) < 0.25] = -100
        out.append({"input_ids": torch.randint(0, VOCAB, (MB_SIZE, SEQ), generator=g), "labels": labels})
    return out


class _Loss:
    def __init__(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self.loss_sum = outputs["loss"].sum()
        self.weight = (labels != -100).sum()


def _body(env: RankEnv, moe: bool) -> None:
    ctx = DistributedContext.create(DeviceMeshParameters(pipeline_parallel=2), backend="gloo")
    torch.manual_seed(0)
    reference = _model(moe, PipelineStageInfo())
    reference.reset_parameters()
    frozen = {n for n in reference.state_dict() if n.startswith("model.embed_tokens")}
    full = reference.state_dict()
    adapter: TypeAdapter[ScheduleConfig] = TypeAdapter(ScheduleConfig)
    for i, (raw, m) in enumerate(CASES):
        setup = PipelineSetup.create(ctx, adapter.validate_python(raw), m)
        stages = {}
        for info in setup.local_stages:
            module = _model(moe, info)
            module.load_state_dict({k: full[k] for k in module.state_dict()})
            for name, p in module.named_parameters():
                p.requires_grad_(name not in frozen)
            stages[info.current_stage] = module
        batch = _batch(m, seed=i)
        weight = sum(int((mb["labels"] != -100).sum()) for mb in batch)

        ref = copy.deepcopy(reference)
        for name, p in ref.named_parameters():
            p.requires_grad_(name not in frozen)
        ref_out = ref(
            input_ids=torch.cat([mb["input_ids"] for mb in batch]),
            labels=torch.cat([mb["labels"] for mb in batch]),
        )
        ref_loss = ref_out["loss"].sum() / weight
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}

        result = setup.executor(stages).train_step(
            batch, lambda out, mb, b=batch: _Loss(out, b[mb]["labels"]), loss_scale=1.0 / weight
        )
        what = f"{'qwen3-moe' if moe else 'qwen3'} {raw['kind']} m={m}"
        if result.loss_sum is not None:
            torch.testing.assert_close(
                result.loss_sum / weight, ref_loss.detach(), rtol=1e-5, atol=0, msg=what
            )
        for s, module in stages.items():
            for name, p in module.named_parameters():
                if name in frozen:
                    assert p.grad is None, f"{what}: frozen {name}"
                    continue
                expected = ref_grads[name]
                assert p.grad is not None and expected is not None, f"{what}: {name}"
                torch.testing.assert_close(
                    p.grad, expected, rtol=1e-5, atol=1e-6, msg=f"{what}: stage {s} {name}"
                )


@pytest.mark.distributed
@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
def test_qwen3_pipeline_matches_whole_model(moe: bool) -> None:
    run_distributed(_body, 2, moe, timeout=300)
