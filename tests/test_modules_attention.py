from __future__ import annotations

import pytest
import torch

from d9d.modules.attention import (
    ATTENTION_BACKEND_ENV,
    AttentionMask,
    AutoSdpa,
    EagerSdpa,
    GroupedQueryAttention,
    TorchSdpa,
    build_sdpa_backend,
    segment_ids_from_position_ids,
)
from d9d.modules.rotary import RotaryEmbedding


def _reference_attention(q, k, v, allowed, scale):
    """float64, one (batch, head, query) at a time."""
    batch, heads, seq, _ = q.shape
    groups = heads // k.shape[1]
    out = torch.zeros(batch, heads, seq, v.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                keys = [j for j in range(seq) if allowed(b, i, j)]
                scores = torch.stack(
                    [q[b, h, i].double() @ k[b, h // groups, j].double() * scale for j in keys]
                )
                weights = torch.softmax(scores, 0)
                out[b, h, i] = sum(
                    w * v[b, h // groups, j].double() for w, j in zip(weights, keys, strict=True)
                )
    return out


PADDING = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
SEGMENTS = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 0, 0]])


@pytest.mark.parametrize("backend", [TorchSdpa(), EagerSdpa(), AutoSdpa()], ids=["torch", "eager", "auto"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kind", ["causal", "padding", "segments"])
def test_backends_match_float64_reference(backend, window, kind) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 8)
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    mask = AttentionMask(
        padding=PADDING if kind == "padding" else None, segment_ids=SEGMENTS if kind == "segments" else None
    )

    def allowed(b: int, i: int, j: int) -> bool:
        if i == j:
            return True
        ok = j < i and (window is None or j > i - window)
        if kind == "padding":
            ok = ok and bool(PADDING[b, j])
        if kind == "segments":
            ok = ok and bool(SEGMENTS[b, i] == SEGMENTS[b, j])
        return ok

    out = backend(q, k, v, mask=mask, window=window, scale=0.3)
    expected = _reference_attention(q, k, v, allowed, 0.3)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


def test_padding_query_rows_stay_finite_with_gradients() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 2, 7, 8, requires_grad=True)
    out = TorchSdpa()(q, q, q, mask=AttentionMask(padding=PADDING), window=None, scale=0.5)
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_segment_ids_from_position_ids() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13]])
    assert segment_ids_from_position_ids(positions).tolist() == [
        [1, 1, 1, 2, 2, 3, 3, 3, 3],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
    ]


def test_build_backend_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "eager")
    assert isinstance(build_sdpa_backend(), EagerSdpa)
    assert isinstance(build_sdpa_backend("torch"), TorchSdpa)  # an explicit choice beats the environment
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "magic")
    with pytest.raises(ValueError, match="D9D_ATTENTION_BACKEND='magic'"):
        build_sdpa_backend()
    monkeypatch.delenv(ATTENTION_BACKEND_ENV)
    assert isinstance(build_sdpa_backend(), AutoSdpa)


def test_gqa_derives_local_heads_from_projections() -> None:
    """Column-sharding q/k/v by head groups and row-sharding o (what tensor parallelism does) gives partial
    outputs that sum to the full output: no reshape may assume the configured head count."""
    torch.manual_seed(0)
    full = GroupedQueryAttention(32, num_heads=4, num_kv_heads=2, head_dim=8, backend=EagerSdpa())
    x = torch.randn(2, 6, 32)
    rotary = RotaryEmbedding(8, 10000.0)(torch.arange(6).expand(2, 6), torch.float32)
    mask = AttentionMask()
    expected = full(x, rotary, mask)
    total = torch.zeros_like(expected)
    for shard in range(2):
        # the module is built with the full head counts; only its parameters shrink, as under TP
        part = GroupedQueryAttention(32, num_heads=4, num_kv_heads=2, head_dim=8, backend=EagerSdpa())
        q_rows, kv_rows = slice(shard * 16, (shard + 1) * 16), slice(shard * 8, (shard + 1) * 8)
        part.q_proj.weight = torch.nn.Parameter(full.q_proj.weight[q_rows].detach().clone())
        part.k_proj.weight = torch.nn.Parameter(full.k_proj.weight[kv_rows].detach().clone())
        part.v_proj.weight = torch.nn.Parameter(full.v_proj.weight[kv_rows].detach().clone())
        part.o_proj.weight = torch.nn.Parameter(full.o_proj.weight[:, q_rows].detach().clone())
        total += part(x, rotary, mask)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)


def test_gqa_head_count_validation() -> None:
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        GroupedQueryAttention(32, num_heads=6, num_kv_heads=4, head_dim=8)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_cuda_backends_match_eager_in_bf16(kind: str) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 32, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, 32, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    padding = torch.ones(2, 64, dtype=torch.bool, device="cuda")
    padding[1, :10] = False
    mask = AttentionMask(padding=padding if kind == "padding" else None)
    reference = EagerSdpa()(q.float(), k.float(), v.float(), mask=mask, window=16, scale=0.2)
    for backend in (TorchSdpa(), AutoSdpa()):
        out = backend(q, k, v, mask=mask, window=16, scale=0.2)
        torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)
        out_full = backend(q, k, v, mask=mask, window=None, scale=0.2)
        ref_full = EagerSdpa()(q.float(), k.float(), v.float(), mask=mask, window=None, scale=0.2)
        torch.testing.assert_close(out_full.float(), ref_full, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_flash_attn_backend_matches_eager() -> None:
    pytest.importorskip("flash_attn")
    from d9d.modules.attention import FlashAttnSdpa

    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 32, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, 32, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for window in (None, 16):
        out = FlashAttnSdpa()(q, k, v, mask=AttentionMask(), window=window, scale=0.2)
        ref = EagerSdpa()(q.float(), k.float(), v.float(), mask=AttentionMask(), window=window, scale=0.2)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="supports plain causal masks only"):
        FlashAttnSdpa()(
            q, k, v, mask=AttentionMask(padding=torch.ones(2, 64, device="cuda")), window=None, scale=0.2
        )
