"""Executor: every schedule's losses and gradients equal a non-pipelined run of the same model.

The tiny model is a stack of Linear + tanh layers split with `balance_layers`: the first stage embeds token
ids, the last one projects to logits. Each stage also receives the microbatch's `mask` (every stage gets the
model inputs) and passes an integer tensor along (`positions`), so non-differentiable transfers are covered.
Some parameters are frozen. The loss is a token-weighted cross entropy with ignored labels, so microbatches
carry different weights and the engine-style `loss_scale = 1 / global weight` is exercised.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from pydantic import TypeAdapter
from torch import nn

from d9d.pipeline.api import PipelineStageInfo, TensorMeta, balance_layers
from d9d.pipeline.runtime.executor import PipelineExecutor, StepResult
from d9d.pipeline.schedule.config import ScheduleConfig, build_schedule
from d9d.pipeline.schedule.program import PipelineProgram

DIM, VOCAB, LAYERS, SEQ, MB_SIZE = 8, 11, 14, 5, 2
FROZEN = ("layers.3.weight", "layers.3.bias", "embed.weight")
SCHEDULES: list[dict[str, object]] = [
    {"kind": "gpipe"},
    {"kind": "1f1b"},
    {"kind": "zb1p"},
    {"kind": "interleaved_1f1b", "stages_per_rank": 2},
    {"kind": "zbv"},
    {"kind": "dualpipev"},
]
schedule_adapter: TypeAdapter[ScheduleConfig] = TypeAdapter(ScheduleConfig)


class TinyStage(nn.Module):
    def __init__(self, stage: PipelineStageInfo) -> None:
        super().__init__()
        self.stage = stage
        self.embed = nn.Embedding(VOCAB, DIM) if stage.is_first else None
        self.layers = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in balance_layers(LAYERS, stage)})
        self.head = nn.Linear(DIM, VOCAB) if stage.is_last else None

    def forward(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        hidden: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.embed is not None:
            hidden = self.embed(input_ids)
            positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        assert hidden is not None and positions is not None
        for layer in self.layers.values():
            hidden = torch.tanh(layer(hidden) + 0.01 * positions[..., None]) * mask[..., None]
        if self.head is not None:
            return self.head(hidden)
        return {"hidden": hidden, "positions": positions}

    def stage_output_meta(self, microbatch_inputs: dict[str, torch.Tensor]) -> dict[str, TensorMeta]:
        b, t = microbatch_inputs["input_ids"].shape
        return {
            "hidden": TensorMeta((b, t, DIM), torch.float32),
            "positions": TensorMeta((b, t), torch.int64),
        }


def reference_model(seed: int = 0) -> TinyStage:
    torch.manual_seed(seed)
    model = TinyStage(PipelineStageInfo(0, 1))
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return model


def build_stage(reference: TinyStage, stage: PipelineStageInfo) -> TinyStage:
    module = TinyStage(stage)
    full = reference.state_dict()
    module.load_state_dict({k: full[k] for k in module.state_dict()})
    for name, p in module.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return module


def make_batch(num_microbatches: int, seed: int) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    inputs, labels = [], []
    for _ in range(num_microbatches):
        ids = torch.randint(0, VOCAB, (MB_SIZE, SEQ), generator=g)
        mask = (torch.rand(MB_SIZE, SEQ, generator=g) > 0.2).float()
        lab = torch.randint(0, VOCAB, (MB_SIZE, SEQ), generator=g)
        lab[torch.rand(MB_SIZE, SEQ, generator=g) < 0.3] = -100
        inputs.append({"input_ids": ids, "mask": mask})
        labels.append(lab)
    return inputs, labels


@dataclass
class Loss:
    loss_sum: torch.Tensor
    weight: torch.Tensor


def loss_fn_for(labels: Sequence[torch.Tensor]) -> Callable[[torch.Tensor, int], Loss]:
    def loss_fn(logits: torch.Tensor, microbatch: int) -> Loss:
        lab = labels[microbatch]
        ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
        return Loss(ce, (lab != -100).sum())

    return loss_fn


def reference_step(
    reference: TinyStage, inputs: Sequence[dict[str, torch.Tensor]], labels: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """Weighted mean loss of the whole batch in one forward/backward, and every parameter's gradient."""
    model = copy.deepcopy(reference)
    logits = model(torch.cat([i["input_ids"] for i in inputs]), torch.cat([i["mask"] for i in inputs]))
    lab = torch.cat(list(labels))
    loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="sum")
    loss = loss / (lab != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def total_weight(labels: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((lab != -100).sum() for lab in labels)  # type: ignore[return-value]


def assert_grads_match(
    stages: dict[int, nn.Module], ref_grads: dict[str, torch.Tensor | None], what: str
) -> None:
    for s, module in stages.items():
        for name, p in module.named_parameters():
            if name in FROZEN:
                assert p.grad is None, f"{what}: frozen {name} got a gradient"
                continue
            expected = ref_grads[name]
            assert p.grad is not None, f"{what}: stage {s} {name} has no gradient"
            torch.testing.assert_close(
                p.grad, expected, rtol=1e-5, atol=1e-6, msg=f"{what}: stage {s} {name}"
            )


def programs_for(pp: int, counts: Sequence[int]) -> list[tuple[ScheduleConfig, int, PipelineProgram]]:
    """Every (schedule, microbatch count) combination the schedules accept; the rest must be refused."""
    out = []
    for raw in SCHEDULES:
        config = schedule_adapter.validate_python(raw)
        for m in counts:
            try:
                out.append((config, m, build_schedule(config, pp, m)))
            except ValueError as e:
                assert config.kind in ("interleaved_1f1b", "dualpipev"), f"{config.kind} refused m={m}: {e}"
    return out


def run_training_case(executor: PipelineExecutor, reference: TinyStage, seed: int, what: str) -> StepResult:
    inputs, labels = make_batch(executor.num_microbatches, seed)
    ref_loss, ref_grads = reference_step(reference, inputs, labels)
    weight = total_weight(labels)
    for module in executor.stages.values():
        module.zero_grad(set_to_none=True)
    result = executor.train_step(inputs, loss_fn_for(labels), loss_scale=1.0 / float(weight))
    assert_grads_match(executor.stages, ref_grads, what)
    if result.loss_sum is not None:
        torch.testing.assert_close(result.loss_sum / weight, ref_loss, rtol=1e-5, atol=0, msg=what)
        assert result.weight == weight
        assert len(result.microbatch_losses) == executor.num_microbatches
    return result


@pytest.mark.parametrize("raw", SCHEDULES, ids=lambda r: str(r["kind"]))
@pytest.mark.parametrize("num_microbatches", [1, 2, 3])
def test_single_rank_matches_reference(raw: dict[str, object], num_microbatches: int) -> None:
    """pp = 1: every stage of the schedule (two for interleaved and V schedules) lives on this rank."""
    config = schedule_adapter.validate_python(raw)
    program = build_schedule(config, 1, num_microbatches)
    reference = reference_model()
    stages = {
        s: build_stage(reference, PipelineStageInfo(s, program.num_stages))
        for s in program.placement.stages_of(0)
    }
    executor = PipelineExecutor(program, stages, pp_rank=0, device=torch.device("cpu"))
    for seed in (1, 2):  # a second step checks that nothing leaks from the first
        run_training_case(executor, reference, seed, f"{config.kind} m={num_microbatches}")
