"""The context-parallel attention strategy a job chooses."""

from __future__ import annotations

from typing import Literal

# `allgather`: keys/values gathered per layer (implemented). `ring`: keys/values passed around the cp
# ranks block by block, overlapped with compute, with an online-softmax merge (not implemented; a config
# asking for it is rejected when validated). Both sit behind `ContextParallelSdpa`'s backend interface.
ContextAttention = Literal["allgather", "ring"]
