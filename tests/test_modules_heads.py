from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from d9d.modules.embedding import TokenEmbedding
from d9d.modules.heads import (
    CausalLMHead,
    EmbeddingHead,
    SequenceClassificationHead,
    linear_cross_entropy,
    pool,
)


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_linear_cross_entropy_matches_full_logits_float64(chunk_size: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 27, (13,))
    labels[[2, 9]] = -100
    grad_out = torch.rand(13, dtype=torch.float64)

    losses = linear_cross_entropy(hidden, [w1, w2], labels, chunk_size=chunk_size)
    (losses.double() * grad_out).sum().backward()
    ours = [t.grad.clone() for t in (hidden, w1, w2)]  # type: ignore[union-attr]
    for t in (hidden, w1, w2):
        t.grad = None

    reference = F.cross_entropy(hidden @ torch.cat([w1, w2]).t(), labels, reduction="none")
    (reference * grad_out).sum().backward()
    torch.testing.assert_close(losses.double(), reference, rtol=1e-6, atol=1e-6)
    assert losses[2] == 0 and losses[9] == 0
    for got, t in zip(ours, (hidden, w1, w2), strict=True):
        torch.testing.assert_close(got, t.grad, rtol=1e-6, atol=1e-9)


def _count_logit_chunks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    lce = importlib.import_module("d9d.modules.heads.linear_cross_entropy")
    calls: list[int] = []
    original = lce.vocab_logits

    def counted(h: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
        calls.append(h.shape[0])
        out: torch.Tensor = original(h, w)
        return out

    monkeypatch.setattr(lce, "vocab_logits", counted)
    return calls


@pytest.mark.parametrize(("ignored", "eager"), [([2, 9], None), (list(range(13)), None), ([2, 9], False)])
def test_linear_cross_entropy_summed_loss_needs_no_recompute(
    monkeypatch: pytest.MonkeyPatch, ignored: list[int], eager: bool | None
) -> None:
    """A sum of the losses gets its gradients from the forward: each chunk's logits are computed once
    (twice with eager_grads=False), and the gradients equal the float64 reference either way."""
    calls = _count_logit_chunks(monkeypatch)
    torch.manual_seed(1)
    hidden = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(7, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 27, (2, 13))
    labels[:, ignored] = -100
    losses = linear_cross_entropy(hidden, [w1, w2], labels, chunk_size=8, eager_grads=eager)
    (losses.sum() / 3.0).backward()
    assert len(calls) == (4 if eager is None else 8)  # 26 tokens in chunks of 8
    ours = [t.grad.clone() for t in (hidden, w1, w2)]  # type: ignore[union-attr]
    for t in (hidden, w1, w2):
        t.grad = None
    logits = hidden @ torch.cat([w1, w2]).t()
    reference = F.cross_entropy(logits.reshape(-1, 27), labels.reshape(-1), reduction="none").view(2, 13)
    (reference.sum() / 3.0).backward()
    torch.testing.assert_close(losses.double(), reference, rtol=1e-6, atol=1e-6)
    for got, t in zip(ours, (hidden, w1, w2), strict=True):
        torch.testing.assert_close(got, t.grad, rtol=1e-6, atol=1e-9)


def test_linear_cross_entropy_without_grad_does_no_gradient_work(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_logit_chunks(monkeypatch)
    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
    lce = importlib.import_module("d9d.modules.heads.linear_cross_entropy")

    def fail(*args: object) -> None:
        pytest.fail("gradients computed under no_grad")

    monkeypatch.setattr(lce, "ce_grad", fail)
    with torch.no_grad():
        linear_cross_entropy(hidden, [weight], torch.randint(0, 5, (6,)), chunk_size=4)
    assert len(calls) == 2


def test_linear_cross_entropy_skips_frozen_split() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(6, 4, requires_grad=True)
    frozen, trained = torch.randn(5, 4), torch.randn(3, 4, requires_grad=True)
    linear_cross_entropy(hidden, [frozen, trained], torch.randint(0, 8, (6,)), chunk_size=4).sum().backward()
    assert frozen.grad is None and trained.grad is not None and hidden.grad is not None


def test_causal_lm_head_logits_and_loss() -> None:
    torch.manual_seed(0)
    head = CausalLMHead(8, {"regular": 10, "special": 3}, loss_chunk_size=4)
    hidden = torch.randn(2, 5, 8)
    logits = head(hidden)
    full_weight = torch.cat([head.weights["regular"], head.weights["special"]])
    torch.testing.assert_close(logits, hidden @ full_weight.t())
    labels = torch.randint(0, 13, (2, 5))
    labels[0, -1] = -100
    loss = head(hidden, labels)
    assert loss.shape == (2, 5) and loss.dtype == torch.float32
    assert loss._base is None  # not a view: FSDP2 warns about (and mishandles in-place ops on) views
    expected = F.cross_entropy(logits.reshape(-1, 13), labels.reshape(-1), reduction="none").view(2, 5)
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match=r"labels shape \(2, 4\) does not match hidden \(2, 5\)"):
        head(hidden, labels[:, :4])


def test_tied_head_shares_parameters_through_to_empty() -> None:
    with torch.device("meta"):
        embedding = TokenEmbedding({"regular": 10, "special": 2}, 8)
        head = CausalLMHead(8, {"regular": 10, "special": 2})
        head.tie_to(embedding)
        model = torch.nn.ModuleDict({"embed": embedding, "head": head})
    model.to_empty(device="cpu")
    embedding.reset_parameters()
    head.reset_parameters()
    assert head.weights["special"] is embedding.weights["special"]
    assert len(list(model.parameters())) == 2
    with pytest.raises(ValueError, match="cannot tie head splits"):
        CausalLMHead(8, {"regular": 12}).tie_to(embedding)


def test_split_embedding_equals_concatenated_table() -> None:
    torch.manual_seed(0)
    emb = TokenEmbedding({"regular": 6, "special": 3, "extra": 2}, 4)
    ids = torch.tensor([[0, 5, 6, 8, 9, 10], [3, 7, 10, 1, 2, 4]])
    table = torch.cat(list(emb.weights.values()))
    torch.testing.assert_close(emb(ids), table[ids])
    emb.weights["regular"].requires_grad_(False)
    emb(ids).sum().backward()
    special_grad = emb.weights["special"].grad
    assert emb.weights["regular"].grad is None and special_grad is not None
    # ids 6 and 8 (special rows 0 and 2) appear once, 7 (row 1) once: each row's grad is all ones
    torch.testing.assert_close(special_grad, torch.ones(3, 4))


def test_vocab_split_validation() -> None:
    with pytest.raises(ValueError, match="split 'special' has size 0"):
        TokenEmbedding({"regular": 4, "special": 0}, 4)
    with pytest.raises(ValueError, match="must be a Python identifier"):
        TokenEmbedding({"not ok": 4}, 4)


def test_pooling_modes_with_left_and_right_padding() -> None:
    hidden = torch.arange(2 * 4 * 1, dtype=torch.float32).view(2, 4, 1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert pool(hidden, mask, "last").flatten().tolist() == [2.0, 7.0]
    assert pool(hidden, mask, "first").flatten().tolist() == [0.0, 5.0]
    assert pool(hidden, mask, "mean").flatten().tolist() == [1.0, 6.0]
    assert pool(hidden, None, "last").flatten().tolist() == [3.0, 7.0]


def test_classification_and_embedding_heads() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    cls = SequenceClassificationHead(8, 4)
    logits = cls(hidden, mask)
    expected = torch.stack([hidden[0, 4], hidden[1, 2], hidden[2, 0]]) @ cls.score.weight.t()
    torch.testing.assert_close(logits, expected)
    labels = torch.tensor([1, -100, 3])
    loss = cls(hidden, mask, labels)
    torch.testing.assert_close(loss, F.cross_entropy(expected, labels, reduction="none"))

    emb = EmbeddingHead(8, pooling="mean", projection_dim=6)
    out = emb(hidden, mask)
    assert out.shape == (3, 6)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(3))
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    torch.testing.assert_close(out, F.normalize(mean @ emb.projection.weight.t(), dim=-1))  # type: ignore[union-attr]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_head_weight_gradient_accumulates_products_unrounded(device: str) -> None:
    """Each chunk's bf16 product enters the float32 weight-gradient accumulator unrounded: 4 · 1.0078125²
    = 4.0627441… is 4.0625 in bf16, so ten rounded chunks would be off by 2.4e-3."""
    from d9d.modules.heads.linear_cross_entropy import _accumulate_product

    acc = torch.zeros(1, 1, device=device)
    a = torch.full((4, 1), 1.0078125, dtype=torch.bfloat16, device=device).t()  # transposed, as the head's
    b = torch.full((4, 1), 1.0078125, dtype=torch.bfloat16, device=device)
    for _ in range(10):
        _accumulate_product(acc, a, b)
    assert abs(float(acc) - 10 * 4 * 1.0078125**2) < 1e-4
