from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from d9d.data import CausalLMCollator
from d9d.models.qwen3 import Qwen3ForCausalLM
from d9d.modules.attention import (
    ATTENTION_BACKEND_ENV,
    AttentionMask,
    AutoSdpa,
    EagerSdpa,
    FlexSdpa,
    GroupedQueryAttention,
    SdpaBackend,
    SdpaCall,
    TorchSdpa,
    build_sdpa_backend,
    segment_ids_from_position_ids,
)
from d9d.modules.attention.backends import FLEX_MIN_HEAD_DIM
from d9d.modules.rotary import RotaryEmbedding
from tests.test_parallel_qwen3 import _dense_config


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
BACKENDS = {"torch": TorchSdpa, "eager": EagerSdpa, "auto": AutoSdpa, "flex": FlexSdpa}


def _call(
    backend: SdpaBackend, q, k, v, mask: AttentionMask, window: int | None, scale: float, prepare: bool
):
    if prepare:
        mask = backend.prepare(mask, seq_len=q.shape[2], windows={window}, device=q.device)
    return backend(SdpaCall(q, k, v, mask=mask, window=window, scale=scale))


@pytest.mark.parametrize("prepare", [True, False], ids=["prepared", "lazy"])
@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kind", ["causal", "padding", "segments", "padding+segments"])
def test_backends_match_float64_reference(name: str, window: int | None, kind: str, prepare: bool) -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 8)
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    padded, segmented = "padding" in kind, "segments" in kind
    mask = AttentionMask(padding=PADDING if padded else None, segment_ids=SEGMENTS if segmented else None)

    def allowed(b: int, i: int, j: int) -> bool:
        if i == j:
            return True
        ok = j < i and (window is None or j > i - window)
        if padded:
            ok = ok and bool(PADDING[b, j])
        if segmented:
            ok = ok and bool(SEGMENTS[b, i] == SEGMENTS[b, j])
        return ok

    # FlexAttention has no CPU backward; its forward is what runs on CPU
    with torch.no_grad():
        out = _call(BACKENDS[name](), q, k, v, mask, window, 0.3, prepare)
    expected = _reference_attention(q, k, v, allowed, 0.3)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


RIGHT = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("segmented", [False, True], ids=["padding", "padding+segments"])
def test_right_padding_drops_the_key_mask_and_matches_the_dense_reference(name: str, segmented: bool) -> None:
    """Declared right padding changes nothing at real positions: the output there equals the eager backend
    with the full dense key mask."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 8)
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    segments = torch.tensor([[0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1, 1]]) if segmented else None
    declared = AttentionMask(padding=RIGHT, segment_ids=segments, padding_side="right")
    assert declared.key_padding is None and declared.is_plain_causal is not segmented
    reference = EagerSdpa()(
        SdpaCall(q, k, v, mask=AttentionMask(padding=RIGHT, segment_ids=segments), window=None, scale=0.3)
    )
    with torch.no_grad():
        out = _call(BACKENDS[name](), q, k, v, declared, None, 0.3, True)
    real = RIGHT[:, None, :, None].expand_as(out)
    torch.testing.assert_close(out[real], reference[real], rtol=1e-5, atol=1e-6)


def test_right_padding_takes_the_causal_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose only mask is right padding reaches SDPA with `is_causal` and GQA, no dense mask."""
    seen: list[dict[str, object]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8)
    mask = AttentionMask(padding=RIGHT, padding_side="right")
    backend = TorchSdpa()
    prepared = backend.prepare(mask, seq_len=7, windows={None}, device=q.device)
    assert not prepared.dense_masks  # nothing materialized
    backend(SdpaCall(q, k, k, mask=prepared, window=None, scale=0.3))
    assert seen == [{"is_causal": True, "scale": 0.3, "enable_gqa": True}]
    seen.clear()
    backend(SdpaCall(q, k, k, mask=AttentionMask(padding=RIGHT), window=None, scale=0.3))
    assert seen[0].get("attn_mask") is not None  # undeclared padding keeps the key mask


def test_prepare_builds_each_window_once_and_layers_reuse_it() -> None:
    mask = AttentionMask(segment_ids=SEGMENTS)
    dense = TorchSdpa().prepare(mask, seq_len=7, windows={None, 3}, device=torch.device("cpu"))
    assert set(dense.dense_masks) == {None, 3}
    assert dense.dense(7, 3, torch.device("cpu")) is dense.dense_masks[3]
    blocks = FlexSdpa().prepare(mask, seq_len=7, windows={None, 3}, device=torch.device("cpu"))
    assert set(blocks.block_masks) == {None, 3}
    assert blocks.block(7, None, torch.device("cpu")) is blocks.block_masks[None]
    # a plain causal layer needs nothing prepared
    causal = FlexSdpa().prepare(AttentionMask(), seq_len=7, windows={None}, device=torch.device("cpu"))
    assert not causal.block_masks and not causal.dense_masks


def test_padding_query_rows_stay_finite_with_gradients() -> None:
    torch.manual_seed(0)
    q = torch.randn(2, 2, 7, 8, requires_grad=True)
    out = TorchSdpa()(SdpaCall(q, q, q, mask=AttentionMask(padding=PADDING), window=None, scale=0.5))
    out.sum().backward()
    assert torch.isfinite(out).all()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _tiny_qwen3(backend: str) -> Qwen3ForCausalLM:
    """The distributed tests' tiny Qwen3, with a sliding-window second layer and the given backend."""
    torch.manual_seed(0)
    config = _dense_config().model_copy(
        update={"attention_backend": backend, "sliding_window": 4, "sliding_window_layers": (1,)}
    )
    return Qwen3ForCausalLM(config)


def test_collated_right_padding_trains_like_the_dense_mask() -> None:
    """The causal-LM collator's right-padded batch, declared as such, gives the dense-mask model's loss and
    gradients (the loss ignores padded positions; real positions never see padded keys)."""
    samples = [
        {"input_ids": torch.randint(0, 43, (n,), generator=torch.Generator().manual_seed(n))}
        for n in (9, 5, 7)
    ]
    collate = CausalLMCollator(pad_id=0, pad_to_multiple_of=4)
    batch = collate(samples)
    assert collate.side == "right" and bool((batch["attention_mask"] == 0).any())
    results = []
    for side in (None, "right"):
        model = _tiny_qwen3("torch")
        loss = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"],
            padding_side=side,
            labels=batch["labels"],
        )["loss"].sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (dense_loss, dense_grads), (causal_loss, causal_grads) = results
    torch.testing.assert_close(causal_loss, dense_loss, rtol=1e-6, atol=1e-6)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(causal_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_model_flex_backend_matches_eager_on_packed_padded_documents() -> None:
    """Documents + left padding + a sliding-window layer through the whole model: flex (block masks built
    once per forward) against the eager reference."""
    ids = torch.randint(0, 43, (2, 12), generator=torch.Generator().manual_seed(1))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :3] = 0
    segments = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 3 + [1] * 9])
    with torch.no_grad():
        logits = {
            name: _tiny_qwen3(name)(input_ids=ids, attention_mask=padding, segment_ids=segments)["logits"]
            for name in ("eager", "flex")
        }
    real = padding.bool()
    torch.testing.assert_close(logits["flex"][real], logits["eager"][real], rtol=1e-4, atol=1e-5)


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
    assert isinstance(build_sdpa_backend("flex"), FlexSdpa)
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "magic")
    with pytest.raises(ValueError, match="D9D_ATTENTION_BACKEND='magic'"):
        build_sdpa_backend()
    monkeypatch.delenv(ATTENTION_BACKEND_ENV)
    assert isinstance(build_sdpa_backend(), AutoSdpa)


def test_auto_logs_its_policy_once(caplog: pytest.LogCaptureFixture) -> None:
    backend = AutoSdpa()
    with caplog.at_level(logging.INFO, logger="d9d.modules.attention.backends"):
        for _ in range(3):
            backend.prepare(AttentionMask(), seq_len=4, windows={None}, device=torch.device("cpu"))
    assert len(caplog.records) == 1 and "attention backend auto on cpu" in caplog.records[0].getMessage()


@pytest.mark.parametrize("head_dim", [8, 16])
def test_auto_on_cuda_sends_heads_narrower_than_flex_takes_to_the_dense_mask(head_dim: int) -> None:
    """CUDA FlexAttention refuses heads under 16 (a tiny model's 8-wide heads failed every masked batch
    there, found on 2 × H200): `auto` gives such calls the dense-mask SDPA, built per call from the block
    masks' source, and it matches the float64 reference."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, head_dim)
    k, v = torch.randn(2, 2, 7, head_dim), torch.randn(2, 2, 7, head_dim)
    backend = AutoSdpa()
    # what `auto` prepares on CUDA: block masks only
    mask = FlexSdpa().prepare(AttentionMask(segment_ids=SEGMENTS), seq_len=7, windows={None}, device=q.device)
    assert mask.block_masks and not mask.dense_masks
    call = SdpaCall(q, k, v, mask=mask, window=None, scale=0.3)
    chosen = backend.backend_for(call, cuda=True)
    assert isinstance(chosen, TorchSdpa if head_dim < FLEX_MIN_HEAD_DIM else FlexSdpa)
    with torch.no_grad():  # FlexAttention has no CPU backward
        out = chosen(call)
    expected = _reference_attention(
        q, k, v, lambda b, i, j: j <= i and bool(SEGMENTS[b, i] == SEGMENTS[b, j]), 0.3
    )
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    plain = SdpaCall(q, k, v, mask=AttentionMask(), window=None, scale=0.3)
    assert isinstance(backend.backend_for(plain, cuda=True), TorchSdpa)  # is_causal, any head size


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
@pytest.mark.parametrize("kind", ["causal", "padding", "right_padding", "segments", "padding+segments"])
@pytest.mark.parametrize("window", [None, 16])
def test_cuda_backends_match_eager_in_bf16(kind: str, window: int | None) -> None:
    """Forward and gradients of every CUDA kernel path (is_causal, dense, compiled FlexAttention) against the
    float32 eager reference with the full dense mask."""
    torch.manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    padding = torch.ones(2, 256, dtype=torch.bool, device="cuda")
    if kind == "right_padding":
        padding[1, 200:] = False
    else:
        padding[1, :10] = False
    segments = torch.arange(256, device="cuda").div(100, rounding_mode="floor").expand(2, 256)
    use_padding = "padding" in kind
    side = "right" if kind == "right_padding" else None
    mask = AttentionMask(
        padding=padding if use_padding else None,
        segment_ids=segments if "segments" in kind else None,
        padding_side=side,
    )
    full = AttentionMask(padding=mask.padding, segment_ids=mask.segment_ids)
    real = padding if use_padding else torch.ones_like(padding)
    weight = real[:, None, :, None].to(torch.float32)
    ref_inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = EagerSdpa()(SdpaCall(*ref_inputs, mask=full, window=window, scale=0.2))
    (reference * weight).sum().backward()
    for backend in (TorchSdpa(), AutoSdpa(), FlexSdpa()):
        prepared = backend.prepare(mask, seq_len=256, windows={window}, device=q.device)
        out = backend(SdpaCall(q, k, v, mask=prepared, window=window, scale=0.2))
        sel = real[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out.float()[sel], reference.detach()[sel], rtol=2e-2, atol=2e-2)
        grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v))
        for got, ref in zip(grads, ref_inputs, strict=True):
            assert ref.grad is not None
            torch.testing.assert_close(got.float(), ref.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_flash_attn_backend_matches_eager() -> None:
    pytest.importorskip("flash_attn")
    from d9d.modules.attention import FlashAttnSdpa

    torch.manual_seed(0)
    q = torch.randn(2, 8, 64, 32, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 64, 32, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for window in (None, 16):
        out = FlashAttnSdpa()(SdpaCall(q, k, v, mask=AttentionMask(), window=window, scale=0.2))
        ref = EagerSdpa()(
            SdpaCall(q.float(), k.float(), v.float(), mask=AttentionMask(), window=window, scale=0.2)
        )
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="supports plain causal masks only"):
        FlashAttnSdpa().prepare(
            AttentionMask(padding=torch.ones(2, 64, device="cuda")),
            seq_len=64,
            windows={None},
            device=q.device,
        )


@pytest.mark.gpu
def test_heads_narrower_than_flex_takes_train_under_auto_and_are_refused_by_flex_on_cuda() -> None:
    """8-wide heads with packed documents: `auto` runs them (dense-mask SDPA) with gradients matching the
    eager reference; the explicit `flex` backend names the limit instead of inductor's lowering error."""
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 8, device="cuda", requires_grad=True)
    k = torch.randn(2, 2, 7, 8, device="cuda", requires_grad=True)
    v = torch.randn(2, 2, 7, 8, device="cuda", requires_grad=True)
    mask = AttentionMask(segment_ids=SEGMENTS.cuda())
    outs = []
    for backend in (AutoSdpa(), EagerSdpa()):
        prepared = backend.prepare(mask, seq_len=7, windows={None}, device=q.device)
        out = backend(SdpaCall(q, k, v, mask=prepared, window=None, scale=0.3))
        outs.append((out, torch.autograd.grad(out.square().sum(), (q, k, v))))
    (auto, auto_grads), (eager, eager_grads) = outs
    torch.testing.assert_close(auto, eager, rtol=1e-5, atol=1e-5)
    for got, ref in zip(auto_grads, eager_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    flex = FlexSdpa()
    prepared = flex.prepare(mask, seq_len=7, windows={None}, device=q.device)
    with pytest.raises(ValueError, match="'flex' on CUDA needs query/key and value heads of at least 16"):
        flex(SdpaCall(q, k, v, mask=prepared, window=None, scale=0.3))


def test_flash_attn_refuses_value_heads_narrower_than_query_heads() -> None:
    """Multi-head latent attention (DeepSeek-V3) has 192-wide query/key heads and 128-wide value heads,
    which flash_attn's kernels do not take: the explicit backend says so before importing the package."""
    from d9d.modules.attention import FlashAttnSdpa

    q = torch.randn(1, 2, 8, 192)
    v = torch.randn(1, 2, 8, 128)
    with pytest.raises(ValueError, match="equal query/key and value head dims"):
        FlashAttnSdpa()(SdpaCall(q, q, v, mask=AttentionMask(), window=None, scale=0.1))


@pytest.mark.parametrize("backend", ["torch", "eager"])
def test_packed_collator_batch_keeps_documents_apart(backend: str) -> None:
    """A packed row from the causal-LM collator, fed with the keys the causal-LM task passes, gives each
    document the logits it gets alone: the collator's `segment_ids` reach the model's mask."""
    model = _tiny_qwen3(backend).double()
    lengths = (5, 7, 3)
    samples = [
        {"input_ids": torch.randint(0, 43, (n,), generator=torch.Generator().manual_seed(n))} for n in lengths
    ]
    batch = CausalLMCollator(pad_id=0, pack_length=16)(samples)
    assert batch["input_ids"].shape[0] == 1
    keys = ("input_ids", "position_ids", "attention_mask", "segment_ids")
    with torch.no_grad():
        packed = model(**{k: batch[k] for k in keys})["logits"][0]
        start = 0
        for sample in samples:
            ids = sample["input_ids"]
            alone = model(input_ids=ids[None])["logits"][0]
            torch.testing.assert_close(packed[start : start + len(ids)], alone)
            start += len(ids)
