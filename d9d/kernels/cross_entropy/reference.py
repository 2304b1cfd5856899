"""The row-wise cross-entropy pieces of the chunked loss head, in plain PyTorch (the kernels' reference).

A chunk of logits [rows, vocab] comes straight from the vocabulary matmul in the model's dtype. Forward
needs each row's log-sum-exp and loss; backward turns the logits into their gradient,
`(softmax - onehot(label)) * scale` per row (0 on ignored rows), in the logits' dtype for the matmuls
that follow. Both compute in at least float32.
"""

from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def ce_rows_torch(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp, loss) per row, loss 0 where the label is `ignore_index`."""
    x = logits.to(accumulation_dtype(logits.dtype))
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != ignore_index
    target = x.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    return lse, torch.where(valid, lse - target, 0.0)


def ce_grad_torch(
    logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """d(sum of scale * loss)/d logits, in the logits' dtype."""
    probs = torch.exp(logits.to(lse.dtype) - lse[:, None])
    probs[torch.arange(probs.shape[0], device=probs.device), labels.clamp(min=0)] -= 1.0
    probs *= torch.where(labels != ignore_index, scale.to(probs.dtype), 0.0)[:, None]
    return probs.to(logits.dtype)
