"""Vocabulary parallelism (distributed cross-entropy, head logits, tied embedding) against one process."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from d9d.modules.embedding import TokenEmbedding
from d9d.modules.heads import CausalLMHead
from d9d.parallel.local_params import sum_gradient
from d9d.parallel.tensor import (
    parallelize_vocab_embedding,
    parallelize_vocab_head,
    vocab_parallel_cross_entropy,
)
from tests.harness import RankEnv, run_distributed

pytestmark = pytest.mark.distributed

# Over 4 ranks: split "a" gives 3, 3, 3, 1 rows, split "b" 1, 1, 1, 0 (the last rank owns none of it).
SPLITS = {"a": 10, "b": 3}
DIM = 5


@contextmanager
def _all_reduce_sizes() -> Iterator[list[int]]:
    """The element count of every all-reduce issued inside, in order (d9d's are torch's functional ones)."""
    issued: list[int] = []
    original = funcol.all_reduce

    def recording(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        issued.append(tensor.numel())
        return original(tensor, *args, **kwargs)  # type: ignore[arg-type]

    funcol.all_reduce = recording  # type: ignore[assignment]
    try:
        yield issued
    finally:
        funcol.all_reduce = original


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(13, DIM, generator=g, dtype=torch.float64)
    hidden = torch.randn(2, 4, DIM, generator=g, dtype=torch.float64)
    labels = torch.tensor([[0, 12, 9, -100], [10, 3, -100, 11]])
    dy = torch.randn(2, 4, generator=g, dtype=torch.float64)
    return weight, hidden, labels, dy


def _vocab(env: RankEnv) -> None:
    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("tp",))
    group = mesh.get_group()
    weight, hidden, labels, dy = _data()
    pieces = [weight[:10].chunk(env.world_size)[env.rank], list(weight[10:].chunk(env.world_size))]
    b_rows = pieces[1][env.rank] if env.rank < len(pieces[1]) else weight[:0]
    local = [pieces[0].clone().requires_grad_(), b_rows.clone().requires_grad_()]
    starts = [3 * env.rank, 10 + min(env.rank, 3)]

    # 1. The function itself, with chunks smaller than the batch.
    ref_w = weight.clone().requires_grad_()
    ref_h = hidden.reshape(-1, DIM).clone().requires_grad_()
    want = F.cross_entropy(ref_h @ ref_w.t(), labels.reshape(-1), ignore_index=-100, reduction="none")
    (want * dy.reshape(-1)).sum().backward()
    h = hidden.reshape(-1, DIM).clone().requires_grad_()
    with _all_reduce_sizes() as issued:
        got = vocab_parallel_cross_entropy(
            sum_gradient(h, group), local, starts, labels.reshape(-1), group, chunk_size=3
        )
    # One collective for all three chunks (per-token statistics of every rank + the target logit); it was a
    # MAX and a SUM all-reduce per chunk.
    assert issued == [(env.world_size + 1) * 8], issued
    (got * dy.reshape(-1)).sum().backward()
    torch.testing.assert_close(got, want)
    close = {"rtol": 1e-7, "atol": 1e-9}
    torch.testing.assert_close(h.grad, ref_h.grad, **close)
    torch.testing.assert_close(
        local[0].grad, ref_w.grad[3 * env.rank : 3 * env.rank + local[0].shape[0]], **close
    )
    torch.testing.assert_close(local[1].grad, ref_w.grad[starts[1] : starts[1] + local[1].shape[0]], **close)

    # 2. Tied embedding + head modules: loss, logits, and the gradient of the shared table.
    for tied in (True, False):
        ref_emb, ref_head = (
            TokenEmbedding(SPLITS, DIM).double(),
            CausalLMHead(DIM, SPLITS, loss_chunk_size=3).double(),
        )
        with torch.no_grad():
            ref_emb.weights["a"].copy_(weight[:10])
            ref_emb.weights["b"].copy_(weight[10:])
            ref_head.weights["a"].copy_(weight[:10].flip(0))
            ref_head.weights["b"].copy_(weight[10:].flip(0))
        emb, head = (
            TokenEmbedding(SPLITS, DIM).double(),
            CausalLMHead(DIM, SPLITS, loss_chunk_size=3).double(),
        )
        emb.load_state_dict(ref_emb.state_dict())
        head.load_state_dict(ref_head.state_dict())
        if tied:
            ref_head.tie_to(ref_emb)
            head.tie_to(emb)
        parallelize_vocab_embedding(emb, mesh)
        parallelize_vocab_head(head, mesh)
        ids = labels.clamp(min=0)
        want_loss = ref_head(ref_emb(ids) * 2.0, labels)
        got_loss = head(emb(ids) * 2.0, labels)
        torch.testing.assert_close(got_loss, want_loss)
        (want_loss * dy).sum().backward()
        (got_loss * dy).sum().backward()
        for name in SPLITS:
            for ref_mod, mod in ((ref_emb, emb), (ref_head, head)):
                got_grad = mod.weights[name].grad.full_tensor()
                torch.testing.assert_close(
                    got_grad, ref_mod.weights[name].grad, **close, msg=f"tied={tied} {name}"
                )
        with torch.no_grad():
            torch.testing.assert_close(head(hidden), ref_head(hidden))


def test_vocab_parallel_matches_single_process() -> None:
    run_distributed(_vocab, 4, timeout=120)


def _summed_gradient_order(env: RankEnv) -> None:
    from torch import nn

    from d9d.parallel.local_params import sum_gradients_over

    # Distinct sizes name each all-reduce; names and module addresses differ between ranks' sets.
    names = ["router", "w_up", "a_bias", "norm", "w_down", "gate", "scale", "b"]
    junk = [object() for _ in range(1000 * env.rank)]  # shift this rank's ids (set order hashes them)
    module = nn.Module()
    for i, name in enumerate(names):
        module.register_parameter(name, nn.Parameter(torch.ones(i + 1)))
    sum_gradients_over(module, set(names), dist.group.WORLD)  # type: ignore[arg-type]
    module.forward = lambda x: sum((x * getattr(module, n)).sum() for n in names)  # type: ignore[method-assign]
    with _all_reduce_sizes() as issued:
        module(torch.tensor(float(env.rank + 1))).backward()
    del junk
    # Autograd runs the summing nodes in reverse order of creation, which is sorted-name order on every rank
    # (a set's order here would pair one parameter's gradient with another's across ranks).
    assert issued == [names.index(n) + 1 for n in sorted(names, reverse=True)], issued
    for name in names:  # d/dp of Σ x·p summed over ranks x = 1, 2
        torch.testing.assert_close(getattr(module, name).grad, torch.full((names.index(name) + 1,), 3.0))


def test_summed_gradients_are_all_reduced_in_the_same_order_on_every_rank() -> None:
    run_distributed(_summed_gradient_order, 2, timeout=60)
