"""The acceptance matrix: tiny Qwen3 / Qwen3-MoE trained 3 steps with AdamW under every strategy mix must
match a single-process run on the same global batch (losses, global grad norms, clipped parameters)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, Qwen3ForSequenceClassification, parallelize_qwen3
from d9d.models.qwen3_moe import Qwen3MoEConfig, Qwen3MoEForCausalLM, parallelize_qwen3_moe
from d9d.parallel import GradSyncConfig, build_gradient_synchronizer
from d9d.parallel.expert import AllToAllBackendConfig
from d9d.parallel.grad_sync import grad_reduce_mesh
from d9d.parallel.plans import ParallelPlanConfig
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_reference import (
    Batch,
    RunResult,
    assert_runs_close,
    distributed_run,
    full_state,
    load_full_state,
    reference_run,
)

pytestmark = pytest.mark.distributed

VOCAB = {"regular": 40, "special": 3}  # the special split does not divide evenly over tp=2
SEQ = 8
MAX_NORM = 0.5


def _dense_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=43,
        vocab_splits=VOCAB,
        hidden_size=16,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=24,
        attention_backend="torch",
        loss_chunk_size=5,
    )


def _dense() -> nn.Module:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(_dense_config())


def _dense_with_bias() -> nn.Module:
    """Projections with biases, drawn away from their zero init: a row-split output projection must add its
    bias once after the sum over tp (and, under sequence parallelism, sum the bias gradient over tp)."""
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_dense_config().model_copy(update={"attention_bias": True}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.5)
    return model


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return Qwen3ForSequenceClassification(_dense_config(), num_labels=3)


def _moe() -> nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoEConfig(
        vocab_size=43,
        vocab_splits=VOCAB,
        hidden_size=16,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=(1,),
        attention_backend="torch",
        grouped_mm="eager",
        loss_chunk_size=5,
    )
    return Qwen3MoEForCausalLM(config)


MODELS = {"qwen3": _dense, "qwen3_moe": _moe, "qwen3_cls": _classifier, "qwen3_bias": _dense_with_bias}


def _task_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    losses = model(input_ids=batch.inputs, labels=batch.targets)["loss"]
    return losses.sum()


def _batches(steps: int, size: int, *, classes: int | None = None) -> list[Batch]:
    """Causal-LM batches (some labels ignored: uneven token counts per rank), or classification ones."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 43, (size, SEQ + 1), generator=g)
        if classes is not None:
            labels = torch.randint(0, classes, (size,), generator=g)
            out.append(Batch(ids[:, :-1], labels, torch.ones(size)))
            continue
        labels = ids[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
        out.append(Batch(ids[:, :-1], labels, (labels != -100).float()))
    return out


@dataclass(frozen=True)
class Case:
    model: str
    replicate: int = 1
    shard: int = 1
    ep: int = 1
    tp: int = 1
    sp: bool = False
    meta: bool = False  # built on the meta device, parallelized, then materialized (late initialization)

    def __str__(self) -> str:
        parts = [
            f"{k}{v}"
            for k, v in (("dp", self.replicate), ("fsdp", self.shard), ("ep", self.ep), ("tp", self.tp))
            if v > 1
        ]
        flags = (" sp" if self.sp else "") + (" meta" if self.meta else "")
        return f"{self.model}[{'×'.join(parts) or 'single'}{flags}]"


def _run_cases(env: RankEnv, cases: list[Case], backend: str = "gloo") -> None:
    device = torch.device("cuda", env.rank) if backend == "nccl" else torch.device("cpu")
    data = {
        name: [b.to(device) for b in _batches(3, 8, classes=3 if name == "qwen3_cls" else None)]
        for name in MODELS
    }
    initial = {name: full_state(build()) for name, build in MODELS.items()}
    references: dict[str, RunResult] = {
        name: reference_run(build().to(device), data[name], _task_loss, max_norm=MAX_NORM)
        for name, build in MODELS.items()
        if any(case.model == name for case in cases)
    }
    for case in cases:
        params = DeviceMeshParameters(
            data_parallel_replicate=case.replicate,
            data_parallel_shard=case.shard,
            tensor_parallel=case.tp,
            expert_parallel=case.ep,
        )
        assert params.world_size == env.world_size, case
        ctx = DistributedContext.create(params, backend="nccl" if backend == "nccl" else "gloo")
        with torch.device("meta" if case.meta else "cpu"):
            model = MODELS[case.model]()
        if not case.meta:
            model.to(device)
        plan = parallelize_qwen3_moe if case.model == "qwen3_moe" else parallelize_qwen3
        plan(
            model, ctx, ParallelPlanConfig(sequence_parallel=case.sp, expert_backend=AllToAllBackendConfig())
        )
        if case.model == "qwen3_moe" and case.ep == 1 and case.tp == 1 and case.shard > 1:
            _assert_experts_sharded_by_fsdp(model, case.shard)
        if case.replicate > 1 and case.shard == case.tp == case.ep == 1:
            _assert_plain_replicas(model)
        if case.meta:
            model.to_empty(device=device)
            model.reset_parameters()  # buffers (rotary tables); weights then come from the "checkpoint"
            load_full_state(model, initial[case.model])
        sync = build_gradient_synchronizer(model, ctx, GradSyncConfig(bucket_size_mb=0.002))
        dp = ctx.coordinates("batch")["dp"]
        local = [b.shard(params.data_parallel, dp).split(2) for b in data[case.model]]
        got = distributed_run(model, sync, local, _task_loss, max_norm=MAX_NORM)
        assert_runs_close(got, references[case.model], str(case))
        sync.close()


def _assert_experts_sharded_by_fsdp(model: nn.Module, shard: int) -> None:
    """Without expert or tensor parallelism the experts are FSDP's, sharded with their block: each rank
    holds 1/shard of them (not a replica with its own optimizer state, as on the expert mesh)."""
    experts = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
    assert experts
    for name, param in experts:
        assert isinstance(param, DTensor), name
        assert param.device_mesh.mesh_dim_names == ("dp_cp_shard",), (name, param.device_mesh)
        assert param.to_local().shape[0] == param.shape[0] // shard, (name, param.to_local().shape)


def _assert_plain_replicas(model: nn.Module) -> None:
    """Replicas alone keep plain parameters (no DTensor views per block and microbatch), each recorded for
    a sum over the data-parallel mesh; the run against one process is what shows the sum happens."""
    for module_name, sub in model.named_modules():
        for name, param in sub.named_parameters(recurse=False):
            assert not isinstance(param, DTensor), f"{module_name}.{name}"
            mesh = grad_reduce_mesh(sub, name)
            assert mesh is not None and mesh.mesh_dim_names == ("dp_cp_replicate",), (module_name, name, mesh)


TWO_RANKS = [
    Case("qwen3", replicate=2),
    Case("qwen3", replicate=2, meta=True),  # plain replicas built on meta, weights loaded afterwards
    Case("qwen3", shard=2),
    Case("qwen3", tp=2),
    Case("qwen3", tp=2, sp=True),
    Case("qwen3_moe", replicate=2, ep=2),
    Case("qwen3_moe", shard=2, ep=2),
    Case("qwen3_moe", shard=2),  # the experts sharded by FSDP with their block
    Case("qwen3_moe", replicate=2),  # and replicated with it
    Case("qwen3_moe", tp=2),
    Case("qwen3_moe", tp=2, ep=2, sp=True),
    Case("qwen3_moe", tp=2, ep=2),  # token-split MoE layers whose tokens are gathered back after the layer
    Case("qwen3_cls", tp=2, sp=True),
    Case("qwen3_bias", tp=2),
    Case("qwen3_bias", tp=2, sp=True),
]

FOUR_RANKS = [
    Case("qwen3", replicate=2, shard=2),
    Case("qwen3", replicate=2, tp=2),
    Case("qwen3", shard=2, tp=2, sp=True),
    Case("qwen3_moe", replicate=2, shard=2, ep=2),
    Case("qwen3_moe", replicate=4, ep=2),
    Case("qwen3_moe", replicate=2, tp=2, ep=4),
    Case("qwen3_moe", replicate=2, tp=2, ep=2),  # ep_replicate mixes tp and dp ranks
    Case("qwen3_moe", shard=2, tp=2, sp=True),  # experts not split over ep: summed over tp, sharded by FSDP
    Case("qwen3", shard=2, tp=2, sp=True, meta=True),
    Case("qwen3_bias", shard=2, tp=2, sp=True),
    Case("qwen3_moe", replicate=2, shard=2, ep=2, meta=True),
    Case("qwen3_moe", replicate=2, shard=2, meta=True),  # HSDP of the experts, built on meta
]


def test_two_rank_matrix() -> None:
    run_distributed(_run_cases, 2, TWO_RANKS, timeout=400)


def test_four_rank_matrix() -> None:
    run_distributed(_run_cases, 4, FOUR_RANKS, timeout=500)


@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_two_gpu_matrix_over_nccl() -> None:
    run_distributed(_run_cases, 2, TWO_RANKS, "nccl", timeout=500, backend="nccl")
