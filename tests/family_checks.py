"""Checks every model family's tests share: its batches split for context parallelism, a matrix of meshes
against one process, and two pipeline stages against the whole model (loss and every gradient)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from pydantic import TypeAdapter
from torch import nn

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.parallel import GradSyncConfig, build_gradient_synchronizer
from d9d.parallel.context import ContextParallelGroup, shard_microbatch
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.schedule.config import ScheduleConfig
from d9d.pipeline.setup import PipelineSetup
from tests.harness import RankEnv
from tests.test_parallel_reference import (
    Batch,
    assert_runs_close,
    distributed_run,
    load_full_state,
    reference_run,
)


def cp_shard(batch: Batch, cp: ContextParallelGroup) -> Batch:
    """This rank's context-parallel share of a batch whose inputs stack (input_ids, position_ids)."""
    ids, positions = batch.inputs.unbind(1)
    local = shard_microbatch({"input_ids": ids, "position_ids": positions, "labels": batch.targets}, cp)
    labels = local["labels"]
    return Batch(
        torch.stack((local["input_ids"], local["position_ids"]), 1), labels, (labels != -100).float()
    )


class _Loss:
    def __init__(self, outputs: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self.loss_sum = outputs["loss"].sum()
        self.weight = (labels != -100).sum()


Parallelize = Callable[[nn.Module, DistributedContext, bool], None]
"""Applies a family's plan to a model (`model, ctx, sequence_parallel`)."""


def matrix_matches_one_process(
    build: Callable[[], nn.Module],
    parallelize: Parallelize,
    data: list[Batch],
    loss: Callable[..., torch.Tensor],
    matrix: list[tuple[dict[str, int], bool, bool]],
    label: str,
    max_norm: float,
) -> None:
    """Every `(mesh, sequence parallel, built on meta)` case trains `data` like one process (losses and
    every gradient); a meta-built model is materialized after parallelization with the reference weights."""
    want = reference_run(build(), data, loss, max_norm=max_norm)
    initial = {k: v.clone() for k, v in build().state_dict().items()}
    for mesh, sp, meta in matrix:
        params = DeviceMeshParameters(**mesh)
        ctx = DistributedContext.create(params, backend="gloo")
        with torch.device("meta" if meta else "cpu"):
            model = build()
        parallelize(model, ctx, sp)
        if meta:
            model.to_empty(device="cpu")
            model.reset_parameters()
            load_full_state(model, initial)
        sync = build_gradient_synchronizer(model, ctx, GradSyncConfig(bucket_size_mb=0.002))
        dp = ctx.coordinates("batch")["dp"]
        local = [b.shard(params.data_parallel, dp).split(2) for b in data]
        if params.context_parallel > 1:
            cp = ContextParallelGroup.from_context(ctx)
            local = [[cp_shard(mb, cp) for mb in step] for step in local]
        got = distributed_run(model, sync, local, loss, max_norm=max_norm)
        assert_runs_close(got, want, f"{label} {mesh} sp={sp} meta={meta}")
        sync.close()


def pipeline_matches_whole_model(env: RankEnv, factory: str, vocab: int, seq: int) -> None:
    """A harness body: two pipeline stages under 1F1B, 4 microbatches, against the whole model built by
    `factory` ("module:function", called as `function(stage_info | None, layers=4)`)."""
    module, name = factory.split(":")
    make: Callable[..., nn.Module] = getattr(importlib.import_module(module), name)
    ctx = DistributedContext.create(DeviceMeshParameters(pipeline_parallel=2), backend="gloo")
    whole = make(layers=4)
    full = whole.state_dict()
    setup = PipelineSetup.create(ctx, TypeAdapter(ScheduleConfig).validate_python({"kind": "1f1b"}), 4)
    stages: dict[int, Any] = {}
    for info in setup.local_stages:
        stage = make(PipelineStageInfo(info.current_stage, info.num_stages), layers=4)
        stage.load_state_dict({k: full[k] for k in stage.state_dict()})
        stages[info.current_stage] = stage
    g = torch.Generator().manual_seed(5)
    batch = [
        {
            "input_ids": torch.randint(0, vocab, (2, seq), generator=g),
            "labels": torch.randint(0, vocab, (2, seq), generator=g),
        }
        for _ in range(4)
    ]
    weight = sum(int((mb["labels"] != -100).sum()) for mb in batch)
    ref = whole(
        input_ids=torch.cat([mb["input_ids"] for mb in batch]),
        labels=torch.cat([mb["labels"] for mb in batch]),
    )
    ref_loss = ref["loss"].sum() / weight
    ref_loss.backward()
    result = setup.executor(stages).train_step(
        batch, lambda out, mb: _Loss(out, batch[mb]["labels"]), loss_scale=1.0 / weight
    )
    if result.loss_sum is not None:
        torch.testing.assert_close(result.loss_sum / weight, ref_loss.detach(), rtol=1e-5, atol=0)
    for s, stage in stages.items():
        for param_name, p in stage.named_parameters():
            expected = whole.get_parameter(param_name).grad
            assert p.grad is not None and expected is not None, param_name
            torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-6, msg=f"stage {s} {param_name}")
