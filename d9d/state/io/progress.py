"""Progress bars for long loads and saves: on in an interactive terminal on rank 0, off otherwise."""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
from tqdm import tqdm


def progress_bar(total: int, description: str, unit: str, enabled: bool | None) -> tqdm[Any]:
    """`enabled=None` decides by itself: logs of batch jobs and the other ranks stay clean."""
    if enabled is None:
        enabled = sys.stderr.isatty() and (not dist.is_initialized() or dist.get_rank() == 0)
    return tqdm(
        total=total,
        desc=description,
        unit=unit,
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled,
        leave=False,
    )
