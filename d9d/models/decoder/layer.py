"""The pre-norm decoder layer the catalogue's families share: `x + attn(norm(x))`, then `x + mlp(norm(x))`,
and, for an MoE layer under expert parallelism's `two_batch_overlap`, the same on two parts of the batch
interleaved."""

from __future__ import annotations

import torch
from torch import nn

from d9d.kernels.backend import KernelBackend
from d9d.modules.attention import AttentionMask
from d9d.modules.mlp import SwiGLU
from d9d.modules.moe import MoELayer, MoEStart
from d9d.modules.norm import RMSNorm
from d9d.modules.rotary import RotaryTables


class PreNormDecoderLayer(nn.Module):
    """A family's layer sets `input_layernorm`, `self_attn` (called as `(x, rotary, mask)`),
    `post_attention_layernorm`, `mlp` (a SwiGLU or an `MoELayer`) and `kernel_backend` (the rotary kernel's
    backend) in its `__init__`. The attention output's residual add and the second norm run as one fused
    add + norm (`RMSNorm.add_forward`); an MoE layer gets the batch's padding to keep it out of its balancing
    loss.

    With `mlp.batch_parts` = P > 1 (`two_batch_overlap`) the batch's rows are split into P parts (the mask's
    `parts`, prepared by the backbone) and run as: attention and routing of part 0, whose dispatch stops
    before its host read of the split sizes; the same for part 1, which the GPU computes while the host waits
    for part 0's read; then each part's exchange, experts and combine. Rows never see each other in a layer,
    so the output is the unsplit layer's (matmuls over fewer rows may round differently on GPUs). Every rank
    splits into P parts, even of fewer rows (an empty part attends nothing but still exchanges, so the
    expert-parallel group's collectives stay paired)."""

    input_layernorm: RMSNorm
    self_attn: nn.Module
    post_attention_layernorm: RMSNorm
    mlp: SwiGLU | MoELayer
    kernel_backend: KernelBackend

    def reset_parameters(self) -> None:
        self.input_layernorm.reset_parameters()
        self.self_attn.reset_parameters()  # type: ignore[operator]
        self.post_attention_layernorm.reset_parameters()
        self.mlp.reset_parameters()

    @property
    def batch_parts(self) -> int:
        """How many parts this layer splits a batch into (what the backbone prepares masks for)."""
        return self.mlp.batch_parts if isinstance(self.mlp, MoELayer) else 1

    def forward(self, hidden: torch.Tensor, rotary: RotaryTables, mask: AttentionMask) -> torch.Tensor:
        rotary = rotary.with_backend(self.kernel_backend)
        if self.batch_parts > 1:
            return self._forward_parts(hidden, rotary, mask)
        normed, hidden = self._attend(hidden, rotary, mask)
        # MoE layers keep padding out of their balancing loss
        ffn = self.mlp(normed, mask.padding) if isinstance(self.mlp, MoELayer) else self.mlp(normed)
        out: torch.Tensor = hidden + ffn
        return out

    def _attend(
        self, hidden: torch.Tensor, rotary: RotaryTables, mask: AttentionMask
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the second norm's output, the residual stream after attention)."""
        attended = self.self_attn(self.input_layernorm(hidden), rotary, mask)
        return self.post_attention_layernorm.add_forward(attended, hidden)

    def _forward_parts(self, hidden: torch.Tensor, rotary: RotaryTables, mask: AttentionMask) -> torch.Tensor:
        assert isinstance(self.mlp, MoELayer)
        parts = self.batch_parts
        if len(mask.parts) != parts:
            raise RuntimeError(
                f"this layer splits its batch into {parts} parts but the attention mask holds "
                f"{len(mask.parts)}: the backbone prepares them (`DecoderBackbone.forward`)"
            )
        residuals: list[torch.Tensor] = []
        starts: list[MoEStart] = []
        split = zip(hidden.tensor_split(parts), rotary.split_rows(parts), mask.parts, strict=True)
        for rows, tables, part_mask in split:
            normed, rows = self._attend(rows, tables, part_mask) if rows.shape[0] else (rows, rows)
            residuals.append(rows)
            starts.append(self.mlp.start(normed))
        ffn = self.mlp.finish(starts, [part_mask.padding for part_mask in mask.parts])
        return torch.cat([rows + out for rows, out in zip(residuals, ffn, strict=True)])
