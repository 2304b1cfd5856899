"""Reference methodology shared by the parallelism tests, and a check of the helpers themselves.

A distributed run must match a single-process run on the same global batch: same initial weights (every
rank builds the full model from one seed, then keeps its shard), the loss is a weighted *sum* per
microbatch, and the gradient synchronizer divides by the global weight sum, which is exactly the
single-process weighted mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.parallel import GradientSynchronizer, clip_grad_norm_, global_grad_norm

RTOL = 1e-5


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full (unsharded) tensor, gathered where sharded."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().clone()
    return out


@torch.no_grad()
def load_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into (possibly sharded) parameters: each rank keeps its own shard."""
    for name, p in model.named_parameters():
        full = state[name]
        if isinstance(p, DTensor):
            local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)


def assert_state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Every tensor within RTOL relative error, measured on the whole tensor: ||got - want|| <= RTOL·||want||.

    Tensor-wise rather than element-wise: AdamW normalizes every element's step, so an element whose
    gradient is nearly zero turns float32 summation-order noise (1e-7 relative) into a visible relative
    error on that one element, while a sharding bug shows up as an O(1) error of the whole tensor.
    """
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for name in want:
        g, w = got[name].double(), want[name].double()
        assert g.shape == w.shape, (what, name, g.shape, w.shape)
        error = float((g - w).norm())
        scale = float(w.norm())
        assert error <= RTOL * scale + 1e-12, (
            f"{what} {name}: relative error {error / max(scale, 1e-30):.2e} > {RTOL:.0e} "
            f"(max abs diff {float((g - w).abs().max()):.2e})"
        )


def assert_values_close(got: Sequence[float], want: Sequence[float], what: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        rtol=RTOL,
        atol=0,
        msg=lambda m: f"{what}: {m}",
    )


@dataclass
class Batch:
    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor  # per-sample loss weight

    def shard(self, parts: int, index: int) -> Batch:
        """The `index`-th of `parts` equal slices along the sample dim (a data-parallel rank's share)."""
        n = self.inputs.shape[0]
        if n % parts:
            raise ValueError(f"{n} samples do not split into {parts} parts")
        sl = slice(index * n // parts, (index + 1) * n // parts)
        return Batch(self.inputs[sl], self.targets[sl], self.weights[sl])

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.inputs.to(device), self.targets.to(device), self.weights.to(device))

    def split(self, microbatches: int) -> list[Batch]:
        return [self.shard(microbatches, i) for i in range(microbatches)]


RunResult = tuple[list[float], list[float], list[dict[str, torch.Tensor]]]


def assert_runs_close(got: RunResult, want: RunResult, what: str) -> None:
    """Losses, global grad norms and every full parameter after every step."""
    assert_values_close(got[0], want[0], f"{what} losses")
    assert_values_close(got[1], want[1], f"{what} grad norms")
    for step, (g, w) in enumerate(zip(got[2], want[2], strict=True)):
        assert_state_close(g, w, f"{what} step {step}")


LossFn = Callable[[nn.Module, Batch], torch.Tensor]  # weighted *sum* of the batch's losses


def _adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # eps well above float32 summation noise. A gradient element that cancels down to ~1e-8 (an embedding
    # row whose token occurrences pull opposite ways) carries ~1e-8 of absolute noise in either run; with
    # a small eps Adam turns it into an update of lr·g/(|g| + eps), i.e. a whole step of noise.
    # foreach as on CUDA (CPU defaults to the per-tensor loop): the multi-tensor path refuses a parameter
    # group that mixes DTensors and plain tensors, which a layout must therefore never produce.
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, eps=1e-4, foreach=True)


def reference_run(
    model: nn.Module,
    batches: Sequence[Batch],
    loss_fn: LossFn,
    *,
    max_norm: float | None = None,
    lr: float = 1e-3,
) -> RunResult:
    """Single process: weighted-mean loss of each global batch, AdamW; returns losses, norms, states."""
    opt = _adamw(model, lr)
    losses, norms, states = [], [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch) / batch.weights.sum()
        loss.backward()
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(float(loss.detach()))
        norms.append(float(norm))
        states.append(full_state(model))
    return losses, norms, states


def distributed_run(
    model: nn.Module,
    sync: GradientSynchronizer,
    local_microbatches: Sequence[Sequence[Batch]],
    loss_fn: LossFn,
    *,
    max_norm: float | None = None,
    lr: float = 1e-3,
    pp_group: dist.ProcessGroup | None = None,
) -> RunResult:
    """Per step: weighted-sum loss per microbatch, synchronizer wait with the local weight sum, global
    norm (clipping when asked), AdamW. The returned loss is the global weighted mean: this rank's loss sum
    scaled by the synchronizer's global weight, summed over the same ranks the weights were."""
    opt = _adamw(model, lr)
    losses, norms, states = [], [], []
    for microbatches in local_microbatches:
        opt.zero_grad(set_to_none=True)
        sync.set_num_microbatches(len(microbatches))
        loss_sum = torch.zeros((), dtype=torch.float64)
        weight = torch.zeros((), dtype=torch.float64)
        for mb in microbatches:
            loss = loss_fn(model, mb)
            loss.backward()
            loss_sum += loss.detach().double().cpu()
            weight += mb.weights.sum().double().cpu()
        total_weight = sync.wait(weight)
        assert total_weight is not None
        if max_norm is None:
            norm = global_grad_norm(model.parameters(), pp_group=pp_group)
        else:
            norm = clip_grad_norm_(model.parameters(), max_norm, pp_group=pp_group)
        opt.step()
        losses.append(float(sync.global_sum(loss_sum)) / float(total_weight))
        norms.append(float(norm))
        states.append(full_state(model))
    return losses, norms, states


def test_load_full_state_roundtrip() -> None:
    model = nn.Linear(3, 2)
    state = {k: torch.randn_like(v) for k, v in full_state(model).items()}
    load_full_state(model, state)
    assert_state_close(full_state(model), state, "roundtrip")
