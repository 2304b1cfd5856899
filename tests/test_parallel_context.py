"""Context parallelism: tiny Qwen3 / Qwen3-MoE with sequences split over cp ranks (load-balanced chunks,
keys/values all-gathered) must train exactly like one process on the whole sequences — losses, gradient
norms and parameters — with packed documents, sliding windows, and combined with dp, FSDP and ep."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from d9d.models.qwen3_moe import Qwen3MoEConfig, Qwen3MoEForCausalLM
from d9d.modules.attention import AttentionMask, ShardedQueries
from d9d.parallel import GradSyncConfig, build_gradient_synchronizer
from d9d.parallel.context import (
    ContextParallelGroup,
    check_sequence_length,
    gathered_order,
    load_balanced_index,
    shard_microbatch,
)
from d9d.parallel.expert import AllToAllBackendConfig
from d9d.parallel.plans import ParallelPlanConfig, parallelize_qwen3
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


# -- training equals one process ------------------------------------------------------------------------


def _dense(window: int | None = None) -> nn.Module:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=16,
            num_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=8,
            intermediate_size=24,
            attention_backend="torch",
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
    packed: bool = True

    def __str__(self) -> str:
        return f"{self.model}[cp{self.cp} dp{self.dp} fsdp{self.fsdp} ep{self.ep} packed={self.packed}]"


def _run_cases(env: RankEnv, cases: list[Case]) -> None:
    for case in cases:
        data = _batches(2, 4, case.packed)
        want = reference_run(MODELS[case.model](), data, _loss, max_norm=MAX_NORM)
        params = DeviceMeshParameters(
            data_parallel_replicate=case.dp,
            data_parallel_shard=case.fsdp,
            context_parallel_shard=case.cp,
            expert_parallel=case.ep,
        )
        ctx = DistributedContext.create(params, backend="gloo")
        model = MODELS[case.model]()
        parallelize_qwen3(model, ctx, ParallelPlanConfig(expert_backend=AllToAllBackendConfig()))
        sync = build_gradient_synchronizer(model, ctx, GradSyncConfig(bucket_size_mb=0.002))
        cp = ContextParallelGroup.from_context(ctx)
        dp = ctx.coordinates("batch")["dp"]
        local = [[_shard(mb, cp) for mb in b.shard(params.data_parallel, dp).split(2)] for b in data]
        got = distributed_run(model, sync, local, _loss, max_norm=MAX_NORM)
        assert_runs_close(got, want, str(case))
        sync.close()


@pytest.mark.distributed
def test_cp2() -> None:
    cases = [
        Case("qwen3", cp=2),
        Case("qwen3", cp=2, packed=False),
        Case("qwen3_window", cp=2),
        Case("qwen3_moe", cp=2, ep=2),
    ]
    run_distributed(_run_cases, 2, cases, timeout=240)


@pytest.mark.distributed
def test_cp4_and_with_dp_fsdp_ep() -> None:
    cases = [
        Case("qwen3", cp=4),
        Case("qwen3", cp=2, dp=2),
        Case("qwen3", cp=2, fsdp=2),
        Case("qwen3_moe", cp=2, dp=2, ep=4),
    ]
    run_distributed(_run_cases, 4, cases, timeout=300)
