"""PyTorch references for the MoE token movement: what the Triton kernels compute, written plainly.

`slot_rows` [tokens, k] holds, for each (token, choice) slot, the row of the expert-grouped buffer that
carries that copy; every row is named by at most one slot (rows no slot names are padding). A negative
entry is an absent slot: it writes no row, adds nothing and has a zero weight gradient (the
expert-parallel exchange sends a token to a rank once and names only that rank's copies of it).
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, the input dtype when wider (float64 tests stay exact)."""
    return torch.promote_types(dtype, torch.float32)


def scatter_rows_torch(
    x: torch.Tensor,
    weights: torch.Tensor | None,
    slot_rows: torch.Tensor,
    num_rows: int,
    *,
    compact: bool | None = None,
) -> torch.Tensor:
    """rows[slot_rows[t, j]] = w[t, j] · x[t] (w = 1 when `weights` is None); unnamed rows are zero.
    `compact`: `_compact` below (None: on CPU)."""
    tokens, k = slot_rows.shape
    acc = accumulation_dtype(x.dtype)
    if _compact(slot_rows, compact):
        slot, token, row = _present_slots(slot_rows)
        src = x[token]
        if weights is not None:
            src = (src.to(acc) * weights.reshape(-1)[slot, None].to(acc)).to(x.dtype)
        rows = x.new_zeros(num_rows, x.shape[1])
        rows[row] = src
        return rows
    dense = x[:, None, :].expand(tokens, k, x.shape[1])
    if weights is not None:
        dense = (dense.to(acc) * weights[..., None].to(acc)).to(x.dtype)
    # Absent slots write into one spare row past the end, dropped after: indices of data-independent
    # size, so no host sync on CUDA (a boolean mask would need one).
    target = torch.where(slot_rows >= 0, slot_rows, num_rows).reshape(-1)
    rows = x.new_zeros(num_rows + 1, x.shape[1])
    rows[target] = dense.reshape(tokens * k, x.shape[1])
    return rows[:num_rows]


def gather_sum_torch(
    rows: torch.Tensor, weights: torch.Tensor | None, slot_rows: torch.Tensor, *, compact: bool | None = None
) -> torch.Tensor:
    """out[t] = Σ_j w[t, j] · rows[slot_rows[t, j]], accumulated in at least float32, returned in the rows'
    dtype. `compact`: `_compact` below (None: on CPU)."""
    acc = accumulation_dtype(rows.dtype)
    if _compact(slot_rows, compact):
        slot, token, row = _present_slots(slot_rows)
        values = rows[row].to(acc)
        if weights is not None:
            values = values * weights.reshape(-1)[slot, None].to(acc)
        out = torch.zeros(slot_rows.shape[0], rows.shape[1], dtype=acc, device=rows.device)
        return out.index_add_(0, token, values).to(rows.dtype)  # serial on CPU: deterministic
    picked = _picked_rows(rows, slot_rows).to(acc)  # [tokens, k, hidden]
    if weights is not None:
        picked = picked * weights[..., None].to(acc)
    return picked.sum(1).to(rows.dtype)


def slot_dot_torch(
    rows: torch.Tensor, grad: torch.Tensor, slot_rows: torch.Tensor, *, compact: bool | None = None
) -> torch.Tensor:
    """[tokens, k] in the accumulation dtype: ⟨rows[slot_rows[t, j]], grad[t]⟩, the gradient of a weighted
    combine (0 for absent slots). `compact`: `_compact` below (None: on CPU)."""
    acc = accumulation_dtype(rows.dtype)
    if _compact(slot_rows, compact):
        slot, token, row = _present_slots(slot_rows)
        out = torch.zeros(slot_rows.numel(), dtype=acc, device=rows.device)
        out[slot] = (rows[row].to(acc) * grad[token].to(acc)).sum(-1)
        return out.view(slot_rows.shape)
    return (_picked_rows(rows, slot_rows).to(acc) * grad[:, None, :].to(acc)).sum(-1)


def _compact(slot_rows: torch.Tensor, compact: bool | None) -> bool:
    """Whether to work on the present slots only. The expert-parallel exchange passes [tokens, k] slots of
    which few may be present (≈ 2 of 8 per row at 64 experts top-8 over 4 ranks): the dense form then moves
    k / present times the data. Compacting counts the present slots, which on CUDA waits for the device,
    so there (where this reference only runs for `backend="torch"` or dtypes the kernels lack) the dense,
    sync-free form is the default."""
    return slot_rows.device.type == "cpu" if compact is None else compact


def _present_slots(slot_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat slot index, token, row) of every present slot, in token-then-slot order."""
    flat = slot_rows.reshape(-1)
    slot = (flat >= 0).nonzero().squeeze(1)
    return slot, slot // slot_rows.shape[1], flat[slot]


def _picked_rows(rows: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    """[tokens, k, hidden]: the row each slot names, zero for absent slots. Selected rather than multiplied
    by a mask, so a non-finite row never reaches a slot that does not name it."""
    if rows.shape[0] == 0:  # only absent slots can point into an empty buffer
        return rows.new_zeros(*slot_rows.shape, rows.shape[1])
    present = (slot_rows >= 0)[..., None]
    return torch.where(present, rows[slot_rows.clamp(min=0)], rows.new_zeros(()))
