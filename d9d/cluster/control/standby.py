"""Warm standby rank actors (`cluster.standby_ranks`): started ahead of time, taken by a restart in place of
cold processes, refilled in the background.

Placement on CPU jobs: each standby lives in a one-bundle placement group of its own holding one rank's
resources (`cluster.resources`), reserved in addition to the running attempt's group. So a standby never
holds a bundle the active group needs: while the cluster has no spare room for it, its group stays pending
and the pool simply has fewer standbys. A restart reserves a group for the cold ranks only (world size minus
the ready standbys it takes); a taken standby's own group then belongs to the attempt and is given back
with it.

Placement on GPU jobs: a standby is a spare process, not a spare GPU. It holds one rank's CPUs on a node
the running attempt's ranks use and starts CUDA with the devices they see there (a GPU is the scarce part:
a standby holding one of its own would idle it, and a one-GPU machine could have none). A restart that
takes it reserves a rank bundle pinned to the standby's node (`WorkerGroup.reserve`), which holds the GPU
the standby then drives, freed by the failed attempt's teardown. It covers faults of a process (a crash,
an OOM kill, a hung collective), not the loss of its node.

Timing: standbys are started (or refilled) once an attempt has completed its first step, so starting them
never competes with a restart for CPU, and a group still pending is withdrawn before a restart reserves its
own (it must not take the bundles the new attempt needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from d9d.cluster.names import NAMESPACE
from d9d.cluster.placement import bundle_for, placement_group_name
from d9d.cluster.rank import RankActor, StandbyReady
from d9d.cluster.spec import JobSpec
from d9d.parallel.compile import compiler_modules

_log = logging.getLogger(__name__)


def standby_name(run_name: str, token: str) -> str:
    """A standby keeps this Ray name when it becomes a rank (names cannot change)."""
    return f"{run_name}/standby-{token}"


@dataclass(frozen=True)
class Standby:
    actor: Any
    pg: PlacementGroup | None  # CPU jobs: its own rank bundle; GPU jobs: None (its CPUs are the actor's)
    ready: StandbyReady


@dataclass(frozen=True)
class StandbySite:
    """Where a GPU job's standby goes: a node the attempt's ranks use and the devices they see there."""

    node_id: str
    cuda_visible_devices: str


def standby_sites(rank_sites: Sequence[StandbySite]) -> list[StandbySite]:
    """The attempt's distinct (node, devices) sites, those with more ranks first: standbys go round-robin
    over them."""
    counts: dict[StandbySite, int] = {}
    for site in rank_sites:
        counts[site] = counts.get(site, 0) + 1
    return sorted(counts, key=lambda site: -counts[site])


class StandbyPool:
    def __init__(self, spec: JobSpec, on_ready: Callable[[Standby], Awaitable[None]] | None = None) -> None:
        self._spec = spec
        self._size = spec.cluster.standby_ranks
        self._on_ready = on_ready
        self._ready: list[Standby] = []
        self._pending: set[asyncio.Task[None]] = set()
        self._started = 0  # standbys started so far: picks the next GPU site round-robin

    @property
    def size(self) -> int:
        return self._size

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    def refill(self, rank_sites: Sequence[StandbySite] = ()) -> None:
        """Start standbys in the background until ready + starting ones make `cluster.standby_ranks`;
        on a GPU job next to the running attempt's ranks (`rank_sites`, one per rank)."""
        missing = self._size - len(self._ready) - len(self._pending)
        sites = standby_sites(rank_sites)
        gpus = self._spec.cluster.resources.gpus > 0
        for _ in range(max(missing, 0)):
            site = sites[self._started % len(sites)] if gpus and sites else None
            if gpus and site is None:
                return  # a GPU job's standby needs a node with the job's GPUs
            self._started += 1
            task = asyncio.get_running_loop().create_task(self._start_one(site))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def withdraw_pending(self) -> None:
        """Stop standbys still starting (their groups may be pending for bundles a restart needs)."""
        tasks = list(self._pending)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def take(self, count: int, alive_nodes: frozenset[str]) -> list[Standby]:
        """Up to `count` ready standbys on alive nodes (those on lost nodes are dropped)."""
        lost = [s for s in self._ready if s.ready.node_id not in alive_nodes]
        for s in lost:
            release(s)
        self._ready = [s for s in self._ready if s.ready.node_id in alive_nodes]
        taken, self._ready = self._ready[:count], self._ready[count:]
        return taken

    def put_back(self, standbys: list[Standby]) -> None:
        """Standbys taken for a layout that could not be placed, still unused."""
        self._ready = standbys + self._ready

    async def close(self) -> None:
        await self.withdraw_pending()
        for s in self._ready:
            release(s)
        self._ready = []

    async def _start_one(self, site: StandbySite | None) -> None:
        spec = self._spec
        c = spec.cluster
        token = uuid.uuid4().hex[:12]
        pg: PlacementGroup | None = None
        actor: Any = None
        try:
            if site is None:
                pg = placement_group(
                    [bundle_for(c.resources)], name=placement_group_name(spec.run_name, f"standby-{token}")
                )
                await asyncio.wait_for(pg.ready(), c.placement_timeout_s)
                strategy: Any = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=0
                )
            else:
                strategy = NodeAffinitySchedulingStrategy(site.node_id, soft=False)
            actor = (
                ray.remote(RankActor)
                .options(
                    name=standby_name(spec.run_name, token),
                    namespace=NAMESPACE,
                    num_cpus=c.resources.cpus,
                    num_gpus=c.resources.gpus if site is None else 0,
                    scheduling_strategy=strategy,
                    max_restarts=0,
                )
                .remote(ray.get_runtime_context().current_actor)
            )
            visible = site.cuda_visible_devices if site is not None else None
            preload = compiler_modules(spec.train.compile, "cuda" if c.resources.gpus else "cpu")
            ready: StandbyReady = await asyncio.wait_for(
                actor.warm.remote(c.entrypoint, visible, preload), spec.init_timeout_s
            )
        except BaseException as e:  # cancelled (a restart), no room, or the actor failed: no standby
            if actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            if pg is not None:
                remove_placement_group(pg)
            if not isinstance(e, asyncio.CancelledError | TimeoutError):
                _log.warning("run %s: a standby rank failed to start: %s", spec.run_name, e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        standby = Standby(actor, pg, ready)
        self._ready.append(standby)
        if self._on_ready is not None:
            await self._on_ready(standby)


def release(standby: Standby) -> None:
    """Kill a standby (or the rank it became) and give its bundle back."""
    with contextlib.suppress(Exception):  # already dead
        ray.kill(standby.actor, no_restart=True)
    if standby.pg is not None:
        remove_placement_group(standby.pg)
