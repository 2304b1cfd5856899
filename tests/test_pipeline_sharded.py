"""Pipeline schedules × FSDP / HSDP × expert parallelism: losses and every gradient equal one process.

FSDP2 reduces a module's gradients when autograd reaches the module's inputs; a split backward (ZB1P, ZBV,
DualPipeV) gets there in its input pass, before the weight pass has computed anything. The executor drives
sharded stages itself (`d9d.pipeline.runtime.sharding`), and this matrix is the test that would have caught
the run that trained without its weight gradients: two steps with an SGD update between them (so a stale
or unsharded parameter shows in the second step), against one process on the whole batch.

Cells (each mechanism at least once; world size 4, so HSDP runs with both stages of a V / interleaved
schedule on one pipeline rank):
- pp 2 × FSDP 2: every schedule, dense and MoE with experts sharded over the FSDP ranks (ep 2); MoE
  without expert parallelism under ZBV and 1F1B.
- pp 1 × HSDP (replicate 2 × shard 2), two stages per rank: the split-backward schedules (ZB1P, ZBV,
  DualPipeV) and interleaved 1F1B, dense and MoE with ep 2 (experts replicated over the other two ranks).
- pp 2 × replicate 2 (± ep 2) under every schedule: `tests/test_pipeline_executor.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.parallel import GradientSynchronizer, collect_synced_params
from d9d.parallel.expert import AllToAllBackendConfig, parallelize_expert_parallel
from d9d.parallel.fsdp import parallelize_fsdp, parallelize_hsdp
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.runtime.executor import PipelineExecutor
from d9d.pipeline.schedule.config import build_schedule
from d9d.pipeline.schedule.program import PipelineProgram
from tests.harness import RankEnv, run_distributed
from tests.test_pipeline_executor import (
    FROZEN,
    SCHEDULES,
    TinyStage,
    _pipeline_executors,
    assert_grads_match,
    build_stage,
    loss_fn_for,
    make_batch,
    reference_model,
    reference_step,
    schedule_adapter,
    total_weight,
)

pytestmark = pytest.mark.distributed

STEPS, LR = 2, 0.5


def _parallelize(ctx: DistributedContext, module: TinyStage) -> None:
    """Experts over ep (when the mesh has it), then FSDP (or HSDP) with every layer its own unit."""
    if module.moe is not None and ctx.params.expert_parallel > 1:
        parallelize_expert_parallel(
            module.moe,
            ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep_shard"],
            device=ctx.device,
            dtype=torch.float32,
            backend=AllToAllBackendConfig(),
        )
    dense = ctx.mesh_for(MeshDomain.DENSE)
    units: list[nn.Module] = list(module.layers.values())
    if dense["dp_cp_replicate"].size() > 1:
        parallelize_hsdp(module, dense["dp_cp_replicate", "dp_cp_shard"], units=units)
    else:
        parallelize_fsdp(module, dense["dp_cp_shard"], units=units)


def _executors(ctx: DistributedContext, reference: TinyStage, programs: list[PipelineProgram]) -> list[Any]:
    if ctx.params.pipeline_parallel > 1:
        return _pipeline_executors(ctx, reference, programs)
    return [
        PipelineExecutor(
            program,
            {
                s: build_stage(reference, PipelineStageInfo(s, program.num_stages))
                for s in program.placement.stages_of(0)
            },
            pp_rank=0,
            device=ctx.device,
        )
        for program in programs
    ]


def _train_and_compare(
    ctx: DistributedContext,
    executor: PipelineExecutor,
    reference: TinyStage,
    what: str,
    parallelize: Callable[[DistributedContext, TinyStage], None] = _parallelize,
) -> None:
    modules = list(executor.stages.values())
    for module in modules:
        parallelize(ctx, module)
    once = executor.reduced_once_per_step()
    assert once, f"{what}: FSDP shards nothing"
    sync = GradientSynchronizer(
        [sp for module in modules for sp in collect_synced_params(module)],
        num_microbatches=executor.num_microbatches,
        loss_weight_mesh=ctx.mesh_for(MeshDomain.BATCH)["dp"],
        once_per_step=once,
    )
    dp, dp_rank = ctx.params.data_parallel, ctx.coordinates(MeshDomain.BATCH)["dp"]
    m = executor.num_microbatches
    for step in range(STEPS):
        batches = [make_batch(m, seed=1000 * step + d) for d in range(dp)]
        ref_loss, ref_grads = reference_step(
            reference,
            [x for inputs, _ in batches for x in inputs],
            [y for _, labels in batches for y in labels],
        )
        inputs, labels = batches[dp_rank]
        result = executor.train_step(inputs, loss_fn_for(labels))
        weight = sync.wait(total_weight(labels))
        assert weight is not None
        at = f"{what} step {step}"
        assert_grads_match(executor.stages, ref_grads, at)
        if result.loss_sum is not None:
            loss = sync.global_sum(result.loss_sum) / weight
            torch.testing.assert_close(loss.float(), ref_loss, rtol=1e-5, atol=0, msg=at)
        with torch.no_grad():  # the same SGD step on both sides; the next step sees the updated weights
            for name, p in reference.named_parameters():
                if name not in FROZEN:
                    p -= LR * ref_grads[name]  # type: ignore[operator]
            for module in modules:
                for name, p in module.named_parameters():
                    if name not in FROZEN:
                        p -= LR * p.grad
        sync.zero_grad()
    sync.close()


Cell = tuple[dict[str, object], int, bool, int]
"""(schedule, microbatches, MoE, expert parallel)."""


def _cells(env: RankEnv, pp: int, cells: list[Cell]) -> None:
    for moe, ep in sorted({(moe, ep) for _, _, moe, ep in cells}):
        dp = (
            {"data_parallel_shard": 2}
            if pp == 2
            else {"data_parallel_replicate": 2, "data_parallel_shard": 2}
        )
        params = DeviceMeshParameters(pipeline_parallel=pp, expert_parallel=ep, **dp)
        ctx = DistributedContext.create(params, backend="gloo")
        chosen = [(raw, m) for raw, m, cell_moe, cell_ep in cells if (cell_moe, cell_ep) == (moe, ep)]
        programs = [build_schedule(schedule_adapter.validate_python(raw), pp, m) for raw, m in chosen]
        for program, executor in zip(
            programs, _executors(ctx, reference_model(moe=moe), programs), strict=True
        ):
            what = f"{params} {program.name} m={program.num_microbatches} {'moe' if moe else 'dense'}"
            _train_and_compare(ctx, executor, reference_model(moe=moe), what)


_SPLIT = ("zb1p", "zbv", "dualpipev")
_FSDP_CELLS: list[Cell] = [
    *[(raw, 4, moe, 2 if moe else 1) for raw in SCHEDULES for moe in (False, True)],
    *[(raw, 4, True, 1) for raw in SCHEDULES if raw["kind"] in ("1f1b", "zbv")],
]
_HSDP_CELLS: list[Cell] = [
    (raw, 3, moe, 2 if moe else 1)
    for raw in SCHEDULES
    if raw["kind"] in (*_SPLIT, "interleaved_1f1b")
    for moe in (False, True)
]


def test_pipeline_fsdp_matrix() -> None:
    run_distributed(_cells, 4, 2, _FSDP_CELLS, timeout=600)


def test_pipeline_hsdp_matrix() -> None:
    run_distributed(_cells, 4, 1, _HSDP_CELLS, timeout=600)
