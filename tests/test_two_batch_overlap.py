"""Expert parallelism's `two_batch_overlap`: each MoE decoder layer runs its batch in two parts, part 1's
attention queued before the host waits for part 0's split sizes.

Checked against the exchange without it (itself checked against one process, test_parallel_expert.py) on
gloo ranks in float64: the backbone's output and every gradient, with packed documents, left padding, a
dense first layer and the balancing loss, at odd and single-row batches (a part of no rows still exchanges);
the order of attention and host reads within a layer; FlexAttention's per-part block masks (forward: CPU has
no FlexAttention backward); the config's refusals. Through the engine, compiled: test_expert_overlap.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.core.host_copy import HostCopy
from d9d.models.qwen3_moe import Qwen3MoEConfig, Qwen3MoEModel
from d9d.modules.attention import AttentionMask
from d9d.modules.moe import MoELayer
from d9d.parallel.expert import AllToAllBackendConfig, parallelize_expert_parallel
from tests.harness import RankEnv, run_distributed

HIDDEN, VOCAB, SEQ = 16, 64, 12


def _model(attention: str) -> Qwen3MoEModel:
    torch.manual_seed(5)
    config = Qwen3MoEConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_layers=3,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=4,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=(0,),  # a dense layer runs its batch whole between split ones
        router_aux_loss_coef=0.1,
        attention_backend=attention,  # type: ignore[arg-type]
        grouped_mm="eager",
    )
    model = Qwen3MoEModel(config)
    model.reset_parameters()
    return model.double()


def _parallel_model(ctx: DistributedContext, attention: str, two_batch_overlap: bool) -> Qwen3MoEModel:
    model = _model(attention)
    for layer in model.decoder_layers().values():
        mlp = layer.mlp  # type: ignore[union-attr]
        if isinstance(mlp, MoELayer):
            parallelize_expert_parallel(
                mlp,
                ctx.mesh_for(MeshDomain.EXPERT)["ep_replicate", "ep_shard"],
                device=ctx.device,
                dtype=torch.float64,
                backend=AllToAllBackendConfig(two_batch_overlap=two_batch_overlap),
                unit=layer,
            )
            assert mlp.batch_parts == (2 if two_batch_overlap else 1)
    return model


def _inputs(rank: int, batch: int) -> dict[str, torch.Tensor]:
    """Packed documents (segments restart mid-row) and left padding on the first row."""
    g = torch.Generator().manual_seed(40 + rank * 7 + batch)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    segments = torch.cumsum(torch.rand(batch, SEQ, generator=g) < 0.25, 1)
    padding = torch.ones(batch, SEQ, dtype=torch.bool)
    padding[0, :3] = False
    return {"input_ids": ids, "segment_ids": segments, "attention_mask": padding}


@contextmanager
def _log_order(model: Qwen3MoEModel, events: list[str]) -> Iterator[None]:
    """Notes each attention call and each host read of split sizes, in the order the host makes them."""
    wait = HostCopy.wait

    def noted_wait(copy: HostCopy) -> torch.Tensor:
        events.append("host read")
        return wait(copy)

    handles = [
        layer.self_attn.register_forward_hook(  # type: ignore[union-attr]
            lambda module, args, out, i=i: events.append(f"attention {i} rows {args[0].shape[0]}")
        )
        for i, layer in model.decoder_layers().items()
    ]
    HostCopy.wait = noted_wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        HostCopy.wait = wait  # type: ignore[method-assign]
        for handle in handles:
            handle.remove()


def _against_sequential(env: RankEnv) -> None:
    ctx = DistributedContext.create(
        DeviceMeshParameters(data_parallel_replicate=env.world_size, expert_parallel=env.world_size),
        backend="gloo",
    )
    # rank 0 with 3 rows (parts of 2 and 1), rank 1 with 1 (parts of 1 and 0), then both with 2
    for batches in ((3, 1), (2, 2)):
        inputs = _inputs(env.rank, batches[env.rank])
        runs: dict[bool, dict[str, Any]] = {}
        for overlap in (False, True):
            model = _parallel_model(ctx, "torch", overlap)
            events: list[str] = []
            with _log_order(model, events):
                out = model(**inputs)
            dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
            (out * dy).sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
            runs[overlap] = {"out": out.detach(), "grads": grads, "events": events}
        what = f"rank {env.rank}, batches {batches}"
        torch.testing.assert_close(runs[True]["out"], runs[False]["out"], rtol=1e-12, atol=1e-12, msg=what)
        for name, want in runs[False]["grads"].items():
            got = runs[True]["grads"][name]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"{what}: {name}")
        rows = batches[env.rank]
        first, second = (rows + 1) // 2, rows // 2
        # layer 0 (dense) whole; each MoE layer: both parts' attention, then both parts' host reads (an empty
        # part attends nothing)
        split = [f"attention {{i}} rows {first}"] + ([f"attention {{i}} rows {second}"] if second else [])
        want_events = [f"attention 0 rows {rows}"]
        for i in (1, 2):
            want_events += [e.format(i=i) for e in split] + ["host read", "host read"]
        assert runs[True]["events"] == want_events, (what, runs[True]["events"])
        assert runs[False]["events"] == [
            e for i in (0, 1, 2) for e in [f"attention {i} rows {rows}"] + (["host read"] if i else [])
        ], (what, runs[False]["events"])


@pytest.mark.distributed
def test_two_batch_overlap_equals_the_sequential_exchange_in_float64() -> None:
    run_distributed(_against_sequential, 2, timeout=120)


def _flex_forward(env: RankEnv) -> None:
    ctx = DistributedContext.create(
        DeviceMeshParameters(data_parallel_replicate=env.world_size, expert_parallel=env.world_size),
        backend="gloo",
    )
    inputs = _inputs(env.rank, 3)
    with torch.no_grad():
        outs = [_parallel_model(ctx, "flex", overlap)(**inputs) for overlap in (False, True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12, msg=f"rank {env.rank}")


@pytest.mark.distributed
def test_two_batch_overlap_builds_each_parts_block_masks() -> None:
    """FlexAttention's block masks cannot be sliced by rows (the slice loses its mask function): each part's
    are built from its own rows by the backbone."""
    run_distributed(_flex_forward, 2, timeout=120)


def test_a_mask_splits_by_rows_as_tensor_split_does() -> None:
    padding = torch.rand(3, 5) < 0.8
    segments = torch.arange(15).view(3, 5) // 4
    parts = AttentionMask(padding=padding, segment_ids=segments, padding_side="left").split_rows(2)
    assert [p.padding.shape[0] for p in parts if p.padding is not None] == [2, 1]
    assert torch.equal(torch.cat([p.segment_ids for p in parts if p.segment_ids is not None]), segments)
    assert all(p.padding_side == "left" and not p.dense_masks for p in parts)
    assert [p.padding for p in AttentionMask().split_rows(2)] == [None, None]


def test_two_batch_overlap_is_refused_with_overlap_chunks() -> None:
    with pytest.raises(ValidationError, match="two_batch_overlap and overlap_chunks"):
        AllToAllBackendConfig(two_batch_overlap=True, overlap_chunks=2)
