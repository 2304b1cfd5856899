"""Where each token copy goes in the expert-grouped buffer: a stable sort by expert, no host sync."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from d9d.kernels.backend import KernelBackend, resolve_backend

# The Triton regroup reads every block's count in each program; past this many blocks sorting is the better
# shape.
_MAX_KERNEL_BLOCKS = 4096


@dataclass(frozen=True)
class ExpertPermutation:
    """`slot_rows` [tokens, k]: the buffer row of copy j of token t. Rows are grouped by expert in ascending
    order, copies of one expert in token order; `rows_per_expert` [experts] sums to `num_rows`."""

    slot_rows: torch.Tensor
    rows_per_expert: torch.Tensor
    num_rows: int


def count_per_expert(
    expert_ids: torch.Tensor, num_experts: int, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 [num_experts] counts of `expert_ids` ([tokens, ...]). Unlike `torch.bincount`, whose output size
    depends on the data, a scatter into a fixed-size buffer never waits for the GPU. With `token_mask`
    [tokens] (True for real tokens) the copies of masked-out tokens are not counted (no sync either: they
    add zero)."""
    flat = expert_ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    if token_mask is None:
        return counts.scatter_add_(0, flat, torch.ones_like(flat))
    copies = token_mask.reshape(-1, 1).to(torch.int64).expand(-1, flat.numel() // token_mask.numel())
    return counts.scatter_add_(0, flat, copies.reshape(-1))


def _sort_key(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`expert_ids` (in [0, num_experts)) in the narrowest integer dtype that holds them. A GPU radix sort
    makes one pass per key byte: int64 ids cost 22 kernels per stable argsort on an H200 where uint8 ids
    cost 8 (0.098 against 0.076 ms at 131,072 copies; docs/benchmarks.md, session 17)."""
    if num_experts <= 256:
        return expert_ids.to(torch.uint8)
    if num_experts <= 2**15:
        return expert_ids.to(torch.int16)
    return expert_ids.to(torch.int32)


def expert_permutation(topk_ids: torch.Tensor, num_experts: int, *, align: int = 1) -> ExpertPermutation:
    """Group the copies of `topk_ids` [tokens, k] by expert, each group starting at a multiple of `align`.

    With `align > 1` (grouped-matmul tiles like aligned groups) the buffer has a fixed size, tokens·k +
    experts·(align - 1), so its shape never depends on the routing; the slack rows stay zero and are
    counted in the last expert's group (a zero row costs a few flops and changes no result).
    """
    if align < 1:
        raise ValueError(f"align={align} must be >= 1")
    tokens, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    counts = count_per_expert(flat, num_experts)
    order = torch.argsort(_sort_key(flat, num_experts), stable=True)  # sorted position → slot
    position = torch.arange(flat.numel(), device=flat.device)
    if align == 1:
        sorted_rows = position
        rows_per_expert = counts
        num_rows = tokens * k
    else:
        sorted_expert = flat[order]
        padded = (counts + align - 1) // align * align
        start = counts.cumsum(0) - counts
        padded_start = padded.cumsum(0) - padded
        sorted_rows = padded_start[sorted_expert] + position - start[sorted_expert]
        num_rows = tokens * k + num_experts * (align - 1)
        slack = num_rows - padded.sum()
        rows_per_expert = torch.cat([padded[:-1], padded[-1:] + slack])
    slot_rows = torch.empty_like(order).scatter_(0, order, sorted_rows)
    return ExpertPermutation(slot_rows.view(tokens, k), rows_per_expert, num_rows)


def block_regroup(
    counts: torch.Tensor, num_rows: int, *, backend: KernelBackend = "auto"
) -> ExpertPermutation:
    """Rows that arrive in blocks ordered (chunk, source, expert), `counts` [chunks, sources, experts] rows
    each and `num_rows` in all (what the expert-parallel exchange receives: every source's rows grouped by
    local expert, per chunk), regrouped by (chunk, expert) with the sources in order inside a group:
    `slot_rows` [num_rows, 1] (each arriving row's new position), `rows_per_expert` [chunks · experts].

    It is `expert_permutation` of each row's (chunk, expert) label, which is what runs off CUDA. On CUDA
    one Triton kernel computes it instead: a block moves whole, so its rows' new positions follow from the
    counts, with no labels and no sort (two or three launches where labelling and sorting take about 18
    kernels and 18 host ops)."""
    if counts.dim() != 3:
        raise ValueError(f"counts must be [chunks, sources, experts], got shape {tuple(counts.shape)}")
    chunks, sources, experts = counts.shape
    if resolve_backend(backend, counts.device) == "triton" and counts.numel() <= _MAX_KERNEL_BLOCKS:
        from d9d.kernels.moe.triton_kernels import block_regroup_slots_triton

        slots = block_regroup_slots_triton(counts, num_rows)[:, None]
        return ExpertPermutation(slots, counts.sum(1).reshape(-1), num_rows)
    labels = torch.arange(chunks * experts, device=counts.device).view(chunks, 1, experts)
    label_of_row = torch.repeat_interleave(  # output_size given: no host sync
        labels.expand(chunks, sources, experts).reshape(-1), counts.reshape(-1), output_size=num_rows
    )
    return expert_permutation(label_of_row[:, None], chunks * experts)
