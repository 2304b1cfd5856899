"""Context parallelism: tiny Qwen3 / Qwen3-MoE with sequences split over cp ranks (load-balanced chunks,
keys/values all-gathered) must train exactly like one process on the whole sequences — losses, gradient
norms and parameters — with packed documents, sliding windows, and combined with dp, FSDP and ep."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.events import ForwardBackwardFinished
from d9d.engine.step import ContextShardedStepRunner, global_loss
from d9d.engine.trainer import Trainer
from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM, parallelize_qwen3
from d9d.models.qwen3_moe import Qwen3MoEConfig, Qwen3MoEForCausalLM
from d9d.modules.attention import (
    AttentionMask,
    EagerSdpa,
    SdpaBackendName,
    SdpaCall,
    ShardedQueries,
    build_sdpa_backend,
)
from d9d.parallel import GradSyncConfig, build_gradient_synchronizer
from d9d.parallel.context import (
    ContextParallelGroup,
    check_sequence_length,
    gathered_order,
    load_balanced_index,
    shard_microbatch,
)
from d9d.parallel.expert import AllToAllBackendConfig
from d9d.parallel.fsdp import reshard_fsdp
from d9d.parallel.plans import ParallelPlanConfig
from tests.engine_fixtures import make_hf_qwen3
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_reference import Batch, assert_runs_close, distributed_run, reference_run

SEQ = 16  # divisible by 2·cp for cp = 2 and 4
VOCAB = 43
MAX_NORM = 0.5

# -- the layout and the mask, single process ------------------------------------------------------------


def test_load_balanced_chunks() -> None:
    # 16 tokens over cp=4: chunks of 2; rank i holds chunks i and 7 - i
    assert load_balanced_index(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert load_balanced_index(16, 4, 2).tolist() == [4, 5, 10, 11]
    held = torch.cat([load_balanced_index(16, 4, r) for r in range(4)])
    assert sorted(held.tolist()) == list(range(16))
    assert torch.equal(held[gathered_order(16, 4)], torch.arange(16))
    # every rank gets the same causal work: the sum over its queries of (position + 1)
    work = [int((load_balanced_index(16, 4, r) + 1).sum()) for r in range(4)]
    assert len(set(work)) == 1


def test_sequence_length_must_split_into_two_chunks_per_rank() -> None:
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 8"):
        check_sequence_length(12, 4)


@pytest.mark.parametrize("window", [None, 5])
def test_sharded_mask_is_the_rows_of_the_full_mask(window: int | None) -> None:
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3], [0] * 12 + [1] * 4])
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 13:] = 0
    full = AttentionMask(padding=padding, segment_ids=segments).dense(16, window, torch.device("cpu"))
    for rank in range(4):
        index = load_balanced_index(16, 4, rank)
        local = AttentionMask(
            padding=padding[:, index],
            segment_ids=segments[:, index],
            sharded=ShardedQueries(index, 16, segment_ids=segments, padding=padding),
        )
        assert not local.is_plain_causal
        assert torch.equal(local.dense(4, window, torch.device("cpu")), full[:, :, index])
        # the FlexAttention mask_mod says the same thing query by query
        mod = local.mask_mod(window)
        for b in range(2):
            for q in range(4):
                row = mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), torch.arange(16))
                assert torch.equal(row, full[b, 0, index[q]])


@pytest.mark.parametrize("backend", ["flex", "torch", "eager"])
def test_a_ranks_queries_against_all_keys_are_rows_of_full_attention(backend: SdpaBackendName) -> None:
    """What `ContextParallelSdpa` hands its kernel (local queries, whole-sequence keys/values, the sharded
    mask) gives exactly the full attention's rows of those queries; FlexAttention on CPU is forward only."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 16, 8, generator=g) for heads in (4, 2, 2))
    segments = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])
    full_mask = AttentionMask(segment_ids=segments)
    want = EagerSdpa()(SdpaCall(q, k, v, mask=full_mask, window=6, scale=0.3))
    kernel = build_sdpa_backend(backend)
    for rank in range(2):
        index = load_balanced_index(16, 2, rank)
        mask = AttentionMask(
            segment_ids=segments[:, index], sharded=ShardedQueries(index, 16, segment_ids=segments)
        )
        mask = kernel.prepare(mask, seq_len=8, windows={6}, device=torch.device("cpu"))
        got = kernel(SdpaCall(q[:, :, index], k, v, mask=mask, window=6, scale=0.3))
        torch.testing.assert_close(got, want[:, :, index], rtol=1e-5, atol=1e-6)


# -- training equals one process ------------------------------------------------------------------------


def _dense(window: int | None = None, backend: SdpaBackendName = "torch", head_dim: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=16,
            num_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=head_dim,
            intermediate_size=24,
            attention_backend=backend,
            sliding_window=window,
            sliding_window_layers=(1,) if window is not None else None,
        )
    )


def _moe() -> nn.Module:
    torch.manual_seed(0)
    return Qwen3MoEForCausalLM(
        Qwen3MoEConfig(
            vocab_size=VOCAB,
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
            attention_backend="eager",
            grouped_mm="eager",
        )
    )


MODELS: dict[str, Callable[[], nn.Module]] = {
    "qwen3": _dense,
    "qwen3_window": lambda: _dense(window=5),
    "qwen3_moe": _moe,
    # CUDA only (no FlexAttention backward on CPU); its compiled kernels need head_dim >= 16
    "qwen3_flex": lambda: _dense(window=5, backend="flex", head_dim=16),
}


def _pack(ids: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    return torch.stack((ids, positions, segments), dim=1)  # one tensor so Batch splits it along samples


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, positions, segments = batch.inputs.unbind(1)
    out = model(input_ids=ids, position_ids=positions, segment_ids=segments, labels=batch.targets)
    loss: torch.Tensor = out["loss"].sum()
    return loss


def _batches(steps: int, size: int, packed: bool) -> list[Batch]:
    """Causal-LM batches; `packed`: rows of 2–3 documents (positions restart, segment ids) of random
    lengths; some labels ignored, so token counts differ per rank."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
        positions = torch.arange(SEQ).expand(size, SEQ).clone()
        segments = torch.zeros(size, SEQ, dtype=torch.long)
        if packed:
            for row in range(size):
                cuts = sorted(torch.randperm(SEQ - 2, generator=g)[:2].add(1).tolist())
                for doc, (start, end) in enumerate(zip([0, *cuts], [*cuts, SEQ], strict=True)):
                    positions[row, start:end] = torch.arange(end - start)
                    segments[row, start:end] = doc
                    labels[row, end - 1] = -100  # no target across a document boundary
        out.append(Batch(_pack(ids[:, :-1], positions, segments), labels, (labels != -100).float()))
    return out


def _shard(batch: Batch, cp: ContextParallelGroup) -> Batch:
    ids, positions, segments = batch.inputs.unbind(1)
    local = shard_microbatch(
        {"input_ids": ids, "position_ids": positions, "segment_ids": segments, "labels": batch.targets}, cp
    )
    labels = local["labels"]
    return Batch(
        _pack(local["input_ids"], local["position_ids"], local["segment_ids"]),
        labels,
        (labels != -100).float(),
    )


@dataclass(frozen=True)
class Case:
    model: str
    cp: int
    dp: int = 1
    fsdp: int = 1
    ep: int = 1
    tp: int = 1
    sp: bool = False
    packed: bool = True
    replicate_cp: bool = False  # cp over context_parallel_replicate: dense weights replicated, not sharded
    split_cp: bool = False  # cp over context_parallel_replicate 2 × context_parallel_shard cp / 2

    def __str__(self) -> str:
        sizes = f"cp{self.cp} dp{self.dp} fsdp{self.fsdp} ep{self.ep} tp{self.tp}"
        flags = f"sp={self.sp} packed={self.packed} replicate_cp={self.replicate_cp} split_cp={self.split_cp}"
        return f"{self.model}[{sizes} {flags}]"


def _saved_bytes(model: nn.Module, batch: Batch) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _loss(model, batch)
    return sum(storages.values())


def _activation_bytes(model: nn.Module, batch: Batch) -> int:
    """Bytes that one more sample adds to what a forward saves for backward: its activations (whatever is
    saved of the parameters does not depend on the batch and cancels out)."""
    return _saved_bytes(model, batch) - _saved_bytes(model, batch.shard(batch.inputs.shape[0], 0))


def _run_cases(env: RankEnv, cases: list[Case], backend: str = "gloo") -> None:
    device = torch.device("cuda", env.rank) if backend == "nccl" else torch.device("cpu")
    for case in cases:
        data = [b.to(device) for b in _batches(2, 4, case.packed)]
        want = reference_run(MODELS[case.model]().to(device), data, _loss, max_norm=MAX_NORM)
        params = DeviceMeshParameters(
            data_parallel_replicate=case.dp,
            data_parallel_shard=case.fsdp,
            context_parallel_shard=1 if case.replicate_cp else case.cp // 2 if case.split_cp else case.cp,
            context_parallel_replicate=case.cp if case.replicate_cp else 2 if case.split_cp else 1,
            expert_parallel=case.ep,
            tensor_parallel=case.tp,
        )
        ctx = DistributedContext.create(params, backend="nccl" if backend == "nccl" else "gloo")
        model = MODELS[case.model]().to(device)
        parallelize_qwen3(
            model, ctx, ParallelPlanConfig(sequence_parallel=case.sp, expert_backend=AllToAllBackendConfig())
        )
        sync = build_gradient_synchronizer(model, ctx, GradSyncConfig(bucket_size_mb=0.002))
        cp = ContextParallelGroup.from_context(ctx)
        dp = ctx.coordinates("batch")["dp"]
        local = [[_shard(mb, cp) for mb in b.shard(params.data_parallel, dp).split(2)] for b in data]
        if case.dp == case.fsdp == case.tp == 1:
            # per-rank activations shrink with cp: the whole-sequence keys/values are all that is not split
            whole = _activation_bytes(
                MODELS[case.model]().to(device), data[0].shard(params.data_parallel, dp).split(2)[0]
            )
            mine = _activation_bytes(model, local[0][0])
            reshard_fsdp(model)  # a forward without backward leaves FSDP's last unit gathered
            assert mine <= whole * (1 / case.cp + 0.25), (str(case), mine, whole)
        got = distributed_run(model, sync, local, _loss, max_norm=MAX_NORM)
        assert_runs_close(got, want, str(case))
        sync.close()


@pytest.mark.distributed
def test_cp2() -> None:
    cases = [
        Case("qwen3_window", cp=2),  # packed documents, and a sliding window on one layer
        Case("qwen3", cp=2, packed=False, replicate_cp=True),
        Case("qwen3_moe", cp=2, ep=2),
    ]
    run_distributed(_run_cases, 2, cases, timeout=240)


@pytest.mark.distributed
def test_cp4_and_with_dp_fsdp_ep_tp() -> None:
    cases = [
        Case("qwen3", cp=4),
        Case("qwen3", cp=4, split_cp=True),  # the sequence split 4 ways: weights sharded 2, replicated 2
        Case("qwen3", cp=2, dp=2),  # HSDP: FSDP over cp, replicas over dp
        Case("qwen3_moe", cp=2, fsdp=2, ep=4),
        Case("qwen3", cp=2, tp=2, sp=True),
        Case("qwen3", cp=2, tp=2),  # the sequence shard replicated over tp
        Case("qwen3_moe", cp=2, tp=2, ep=2, sp=True),  # token-split MoE layers inside each sequence shard
    ]
    run_distributed(_run_cases, 4, cases, timeout=400)


@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_cp2_over_nccl_with_flex_attention() -> None:
    cases = [Case("qwen3_flex", cp=2), Case("qwen3_moe", cp=2, ep=2)]
    run_distributed(_run_cases, 2, cases, "nccl", timeout=500, backend="nccl")


@pytest.mark.gpu
@pytest.mark.gpus(4)
def test_cp_with_fsdp_and_ep_over_nccl_on_four_gpus() -> None:
    cases = [
        Case("qwen3_flex", cp=2, fsdp=2),  # FSDP over dp × cp
        Case("qwen3_moe", cp=2, fsdp=2, ep=4),  # experts over every rank, sequences split in two
    ]
    run_distributed(_run_cases, 4, cases, "nccl", timeout=500, backend="nccl")


# -- the engine: sharded batches, the loss and its token count --------------------------------------------


def _engine_config(run_dir: Path, mesh: dict[str, int]) -> dict[str, Any]:
    return {
        "run": {"name": "cp", "dir": str(run_dir)},
        "mesh": mesh,
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 2},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"save_at_end": False},
        "model": {"provider": "qwen3", "options": {"source_checkpoint": str(run_dir.parent / "hf")}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


class _CountTokens:
    """A step runner that only reports its microbatches' target tokens as the loss weight."""

    loss_pp_rank = 0

    def forward_backward(self, microbatches: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        weight = sum(float((mb["labels"] != -100).sum()) for mb in microbatches)
        return torch.zeros((), dtype=torch.float64), torch.tensor(weight, dtype=torch.float64)


def _engine_run(env: RankEnv, meshes: list[dict[str, int]]) -> None:
    for i, mesh in enumerate(meshes):
        config = parse_config(_engine_config(env.tmp_dir / f"run{env.world_size}-{i}", mesh))
        trainer = Trainer(
            config, DistributedContext.create(config.mesh), LocalRunReporter(config.checkpoint_dir, 1)
        )
        weights: list[float] = []  # the global loss weight of each step: the batch's target tokens
        trainer.events.subscribe(ForwardBackwardFinished, lambda event, out=weights: out.append(event.weight))
        trainer.setup()
        result = trainer.train()
        if env.rank == 0:
            torch.save((list(result.losses), weights), env.tmp_dir / f"losses{env.world_size}-{i}.pt")
    if env.world_size == 2:
        ctx = DistributedContext.create(DeviceMeshParameters(context_parallel_shard=2), backend="gloo")
        labels = torch.arange(2 * SEQ).reshape(2, SEQ)
        labels[0, :5] = -100
        runner = ContextShardedStepRunner(_CountTokens(), ContextParallelGroup.from_context(ctx))
        loss_sum, weight = runner.forward_backward([{"input_ids": labels.clamp(min=0), "labels": labels}])
        assert float(weight) < 2 * SEQ - 5  # each rank counts its own share ...
        assert float(global_loss(ctx, loss_sum, weight)[1]) == 2 * SEQ - 5  # ... and every token once


@pytest.mark.distributed
def test_engine_trains_with_cp_like_one_process(tmp_path: Path) -> None:
    make_hf_qwen3(tmp_path / "hf", num_layers=2)
    run_distributed(_engine_run, 1, [{}], tmp_dir=tmp_path, timeout=200)
    run_distributed(_engine_run, 2, [{"context_parallel_shard": 2}], tmp_dir=tmp_path, timeout=200)
    run_distributed(
        _engine_run,
        4,
        [{"context_parallel_shard": 2, "pipeline_parallel": 2}],
        tmp_dir=tmp_path,
        timeout=300,
    )
    reference, tokens = torch.load(tmp_path / "losses1-0.pt")
    assert len(reference) == 2 and tokens == [4 * 8] * 2  # 4 samples × 8 targets per step
    for name in ("losses2-0.pt", "losses4-0.pt"):
        losses, weights = torch.load(tmp_path / name)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-5, atol=1e-6)
        assert weights == tokens, name  # every token counted once, so tokens/s too


def test_config_rejects_what_context_parallelism_cannot_run(tmp_path: Path) -> None:
    raw = _engine_config(tmp_path / "run", {"context_parallel_shard": 2})
    raw["model"] = {
        "provider": "qwen3",
        "options": {"architecture": {**_TINY, "attention_backend": "flash_attn"}},
    }
    with pytest.raises(ConfigError, match=r"context_parallel.*attention_backend 'flash_attn'"):
        parse_config(raw, check_components=False)
    raw["model"]["options"]["architecture"]["attention_backend"] = "auto"
    raw["model"]["options"]["parallel"] = {"context_attention": "ring"}
    with pytest.raises(ConfigError, match=r"context_attention='ring' is not implemented"):
        parse_config(raw, check_components=False)
    raw["model"]["options"].pop("parallel")
    raw["data"] = {
        "provider": "text",
        "options": {"dataset": {"paths": [str(tmp_path / "x.txt")]}, "pad_to_multiple_of": 6},
    }
    with pytest.raises(
        ConfigError, match=r"data.options.pad_to_multiple_of=6 must be a multiple of 2·cp = 4"
    ):
        parse_config(raw, check_components=False)
    raw["data"]["options"]["pad_to_multiple_of"] = 8
    raw["task"] = {"provider": "tests.engine_fixtures:TokenCETask"}
    with pytest.raises(ConfigError, match=r"task.provider must be 'causal_lm'"):
        parse_config(raw, check_components=False)


_TINY = {
    "vocab_size": 32,
    "hidden_size": 16,
    "num_layers": 2,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "intermediate_size": 16,
}
