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
import torch.distributed as dist
import torch.nn.functional as F
from pydantic import TypeAdapter
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.modules.moe import GroupedExperts, MoELayer, TopKRouter
from d9d.parallel import (
    GradientSynchronizer,
    collect_synced_params,
    parallelize_replicate,
    replicate_plain,
)
from d9d.parallel.expert import AllToAllBackendConfig, parallelize_expert_parallel
from d9d.pipeline.api import PipelineStageInfo, TensorMeta, balance_layers
from d9d.pipeline.runtime.channels import P2PChannels, pipeline_groups, program_channels
from d9d.pipeline.runtime.executor import PipelineExecutor, StepResult
from d9d.pipeline.schedule.config import InferenceSchedule, ScheduleConfig, ZBVSchedule, build_schedule
from d9d.pipeline.schedule.program import PipelineProgram
from d9d.pipeline.setup import PipelineSetup
from tests.harness import RankEnv, run_distributed

DIM, VOCAB, LAYERS, SEQ, MB_SIZE = 8, 11, 14, 5, 2
FROZEN = ("layers.3.weight", "layers.3.bias", "embed.weight")
MOE_AFTER = 8
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
    """With `moe`, a mixture-of-experts layer (4 experts, top 2) follows layer MOE_AFTER, on whichever stage
    holds that layer."""

    def __init__(self, stage: PipelineStageInfo, moe: bool = False) -> None:
        super().__init__()
        self.stage = stage
        self.embed = nn.Embedding(VOCAB, DIM) if stage.is_first else None
        self.layers = nn.ModuleDict({str(i): nn.Linear(DIM, DIM) for i in balance_layers(LAYERS, stage)})
        has_moe = moe and str(MOE_AFTER) in self.layers
        self.moe = MoELayer(TopKRouter(DIM, 4, 2), GroupedExperts(4, DIM, 6)) if has_moe else None
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
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        assert hidden is not None and positions is not None
        for index, layer in self.layers.items():
            hidden = torch.tanh(layer(hidden) + 0.01 * positions[..., None]) * mask[..., None]
            if self.moe is not None and index == str(MOE_AFTER):
                hidden = hidden + self.moe(hidden)
        if self.head is not None:
            return self.head(hidden)
        return {"hidden": hidden, "positions": positions}

    def stage_output_meta(self, microbatch_inputs: dict[str, torch.Tensor]) -> dict[str, TensorMeta]:
        b, t = microbatch_inputs["input_ids"].shape
        return {
            "hidden": TensorMeta((b, t, DIM), torch.float32),
            "positions": TensorMeta((b, t), torch.int64),
        }


def reference_model(seed: int = 0, moe: bool = False) -> TinyStage:
    torch.manual_seed(seed)
    model = TinyStage(PipelineStageInfo(0, 1), moe)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return model


def build_stage(reference: TinyStage, stage: PipelineStageInfo) -> TinyStage:
    """The stage's slice of the reference model."""
    module = TinyStage(stage, moe=reference.moe is not None)
    full = reference.state_dict()
    module.load_state_dict({k: full[k] for k in module.state_dict()})
    for name, p in module.named_parameters():
        p.requires_grad_(name not in FROZEN)
    return module.to(next(reference.parameters()).device)


def make_batch(
    num_microbatches: int, seed: int, device: torch.device | None = None
) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    inputs, labels = [], []
    for _ in range(num_microbatches):
        ids = torch.randint(0, VOCAB, (MB_SIZE, SEQ), generator=g)
        mask = (torch.rand(MB_SIZE, SEQ, generator=g) > 0.2).float()
        lab = torch.randint(0, VOCAB, (MB_SIZE, SEQ), generator=g)
        lab[torch.rand(MB_SIZE, SEQ, generator=g) < 0.3] = -100
        inputs.append({"input_ids": ids.to(device), "mask": mask.to(device)})
        labels.append(lab.to(device))
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
            grad, expected = p.grad, ref_grads[name]
            assert grad is not None and expected is not None, f"{what}: stage {s} {name} has no gradient"
            if isinstance(grad, DTensor):  # compare this rank's shard
                expected = distribute_tensor(expected, grad.device_mesh, grad.placements, src_data_rank=None)
                grad, expected = grad.to_local(), expected.to_local()
            msg = f"{what}: stage {s} {name}"
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=msg)


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
    inputs, labels = make_batch(executor.num_microbatches, seed, executor.device)
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
    shared_loss, shared_weight = executor.share_loss(result)  # every pipeline rank gets the totals
    torch.testing.assert_close(shared_loss / weight, ref_loss.double(), rtol=1e-5, atol=0, msg=what)
    assert shared_weight == weight
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


# -- several ranks ---------------------------------------------------------------------------------------


def _pipeline_executors(
    ctx: DistributedContext, reference: TinyStage, programs: Sequence[PipelineProgram]
) -> list[PipelineExecutor]:
    """One executor per program, sharing one set of channel groups (created once for all programs)."""
    mesh = ctx.mesh_for(MeshDomain.REGULAR)
    channels = P2PChannels.create(
        pipeline_groups(mesh), {c for p in programs for c in program_channels(p)}, ctx.device
    )
    pp_rank = ctx.coordinates(MeshDomain.REGULAR)["pp"]
    executors = []
    for program in programs:
        stages = {
            s: build_stage(reference, PipelineStageInfo(s, program.num_stages))
            for s in program.placement.stages_of(pp_rank)
        }
        executors.append(
            PipelineExecutor(
                program,
                stages,
                pp_rank=pp_rank,
                device=ctx.device,
                channels=channels,
                pp_group=mesh["pp"].get_group(),
            )
        )
    return executors


def _counts(pp: int) -> list[int]:
    return [pp, pp + 1, 2 * pp, 2 * pp + 1] if pp == 2 else [pp, 2 * pp, 2 * pp + 1]


def _pipeline_body(env: RankEnv, pp: int) -> None:
    ctx = DistributedContext.create(DeviceMeshParameters(pipeline_parallel=pp), backend="gloo")
    reference = reference_model()
    programs = [program for _, _, program in programs_for(pp, _counts(pp))]
    for i, executor in enumerate(_pipeline_executors(ctx, reference, programs)):
        what = f"pp={pp} {executor.program.name} m={executor.num_microbatches}"
        result = run_training_case(executor, reference, seed=i, what=what)
        holds_last = executor.program.num_stages - 1 in executor.stages
        assert (result.loss_sum is not None) == holds_last, what

    # Wiring from a DistributedContext, as the engine does it.
    setup = PipelineSetup.create(ctx, ZBVSchedule(), 2 * pp)
    stages = {info.current_stage: build_stage(reference, info) for info in setup.local_stages}
    run_training_case(setup.executor(stages), reference, seed=99, what=f"pp={pp} via PipelineSetup")

    for stages_per_rank in (1, 2):
        setup = PipelineSetup.create(ctx, InferenceSchedule(stages_per_rank=stages_per_rank), pp + 1)
        stages = {info.current_stage: build_stage(reference, info) for info in setup.local_stages}
        inputs, _ = make_batch(pp + 1, seed=5)
        got: dict[int, torch.Tensor] = {}

        def collect(logits: torch.Tensor, microbatch: int, got: dict[int, torch.Tensor] = got) -> None:
            got[microbatch] = logits

        setup.executor(stages).forward_step(inputs, collect)
        if setup.program.num_stages - 1 in stages:
            with torch.no_grad():
                for mb, item in enumerate(inputs):
                    expected = reference(item["input_ids"], item["mask"])
                    torch.testing.assert_close(got[mb], expected, rtol=1e-5, atol=1e-6)
        else:
            assert not got


@pytest.mark.distributed
@pytest.mark.parametrize("pp", [2, 4])
def test_every_schedule_matches_reference_across_ranks(pp: int) -> None:
    run_distributed(_pipeline_body, pp, pp, timeout=300)


def _hybrid_body(env: RankEnv, expert_parallel: int) -> None:
    """pp=2 × dp=2 (ranks of a dp pair see different data), with experts sharded over ep when asked."""
    params = DeviceMeshParameters(
        pipeline_parallel=2, data_parallel_replicate=2, expert_parallel=expert_parallel
    )
    ctx = DistributedContext.create(params, backend="gloo")
    moe = expert_parallel > 1
    reference = reference_model(moe=moe)
    dp_rank = ctx.coordinates(MeshDomain.BATCH)["dp"]
    programs = [program for _, _, program in programs_for(2, [3, 4])]
    for i, executor in enumerate(_pipeline_executors(ctx, reference, programs)):
        what = f"pp=2 dp=2 ep={expert_parallel} {executor.program.name} m={executor.num_microbatches}"
        m = executor.num_microbatches
        both = [make_batch(m, seed=100 * i + d) for d in range(2)]
        ref_loss, ref_grads = reference_step(
            reference, [x for inputs, _ in both for x in inputs], [y for _, labels in both for y in labels]
        )
        modules = list(executor.stages.values())
        for module in modules:
            if module.moe is not None:
                expert_mesh = ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep_shard"]
                parallelize_expert_parallel(
                    module.moe,
                    expert_mesh,
                    device=ctx.device,
                    dtype=torch.float32,
                    backend=AllToAllBackendConfig(),
                )
                assert module.moe.experts.gate_up_proj.to_local().shape[0] == 4 // expert_parallel
            # as the decoder plan does: plain replicas where no parameter is a DTensor
            dense = ctx.mesh_for(MeshDomain.DENSE)["dp_cp_replicate"]
            if moe:
                parallelize_replicate(module, dense)
            else:
                replicate_plain(module, dense)
        sync = GradientSynchronizer(
            [p for module in modules for p in collect_synced_params(module)],
            num_microbatches=executor.num_microbatches,
            loss_weight_mesh=ctx.mesh_for(MeshDomain.BATCH)["dp"],
        )
        inputs, labels = both[dp_rank]
        result = executor.train_step(inputs, loss_fn_for(labels))
        global_weight = sync.wait(total_weight(labels))
        assert global_weight is not None
        assert_grads_match(executor.stages, ref_grads, what)
        if result.loss_sum is not None:
            loss = sync.global_sum(result.loss_sum) / global_weight
            torch.testing.assert_close(loss.float(), ref_loss, rtol=1e-5, atol=0, msg=what)
        sync.close()


@pytest.mark.distributed
@pytest.mark.parametrize("expert_parallel", [1, 2], ids=["pp2xdp2", "pp2xep2"])
def test_pipeline_with_data_and_expert_parallel_matches_reference(expert_parallel: int) -> None:
    run_distributed(_hybrid_body, 4, expert_parallel, timeout=300)


def _nccl_body(env: RankEnv) -> None:
    device = torch.device("cuda", env.rank)
    torch.cuda.set_device(device)
    store = dist.FileStore(str(env.tmp_dir / ".nccl-rendezvous"), env.world_size)
    dist.init_process_group("nccl", store=store, rank=env.rank, world_size=env.world_size, device_id=device)
    ctx = DistributedContext.create(DeviceMeshParameters(pipeline_parallel=2), backend="nccl")
    reference = reference_model().to(device)
    programs = [program for _, _, program in programs_for(2, _counts(2))]
    for i, executor in enumerate(_pipeline_executors(ctx, reference, programs)):
        what = f"nccl pp=2 {executor.program.name} m={executor.num_microbatches}"
        run_training_case(executor, reference, seed=i, what=what)


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.gpus(2)
def test_every_schedule_on_nccl() -> None:
    """The channel groups on NCCL: every schedule runs without deadlock and matches the reference."""
    run_distributed(_nccl_body, 2, timeout=300, init_process_group=False)
