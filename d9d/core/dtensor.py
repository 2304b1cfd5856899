"""Reading a DTensor's local shard without DTensor dispatch."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: scaling it scales the DTensor), else the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[no-any-return]
