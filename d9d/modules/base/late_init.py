"""Late initialization: build on the meta device, shard, then materialize."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ModuleLateInit(Protocol):
    """A module whose weights can be (re)initialized after construction.

    Models are constructed under `torch.device("meta")` so that nothing is allocated before the parallelism
    layout is known; after sharding, `module.to_empty(device=...)` allocates the (local shards of the)
    storage and `reset_parameters()` fills it. Implementations initialize only the tensors they own
    directly and delegate to their child blocks, so each block keeps control of its own init scale.
    """

    def reset_parameters(self) -> None: ...
