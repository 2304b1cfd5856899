"""How many ranks an attempt runs with: shrink to what the cluster can hold, grow when room comes back.

Pure decisions over numbers the caller reads from Ray (node capacity, free resources, alive nodes), so
they can be tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from d9d.cluster.elastic import WorldPlan
from d9d.cluster.spec import JobSpec


@dataclass
class ScalingPolicy:
    # Valid layouts with at most n ranks, largest first (only the layout for exactly n when not elastic).
    plans: Callable[[int], Sequence[WorldPlan]]
    elastic: bool
    max_workers: int
    # Alive nodes when a resize last fell short of its target (fragmented room): no new attempt to grow
    # until the set of nodes changes.
    blocked: frozenset[str] | None = None

    @classmethod
    def for_job(cls, spec: JobSpec) -> ScalingPolicy:
        def plans(workers: int) -> Sequence[WorldPlan]:
            return spec.plans(max_workers=workers) if spec.elastic else [spec.plan(workers)]

        return cls(plans=plans, elastic=spec.elastic, max_workers=spec.max_workers)

    def candidates(self, target: int, capacity: int) -> list[WorldPlan]:
        """Layouts to try in turn for an attempt aiming at `target` ranks: those the alive nodes can hold
        (`capacity` rank bundles), largest first; the smallest valid one when none fits (it may still be
        placed once a node comes back)."""
        plans = list(self.plans(target))
        return [p for p in plans if p.world_size <= capacity] or plans[-1:]

    def resize_reserved(self, target: int, world_size: int, alive: frozenset[str]) -> None:
        """A resize aimed at `target` ranks got `world_size`: when fewer, the free room was fragmented
        across nodes, and growing waits until the set of `alive` nodes changes."""
        if world_size < target:
            self.blocked = alive

    def may_grow(self, world_size: int) -> bool:
        return self.elastic and world_size < self.max_workers

    def grow_to(self, world_size: int, free: int, alive: frozenset[str]) -> int | None:
        """At a commit: the larger world size to restart with when `free` more rank bundles fit, else None."""
        if not self.may_grow(world_size):
            return None
        if self.blocked is not None and self.blocked == alive:
            return None
        plans = self.plans(min(self.max_workers, world_size + free))
        if plans and plans[0].world_size > world_size:
            return plans[0].world_size
        return None
