"""The worker group of one attempt, the only part of the controller that talks to Ray: it reserves a
placement group, starts one rank actor per bundle, and tears them all down.

With warm standbys (`d9d.cluster.control.standby`), the group is reserved for the cold ranks only and the
ready standbys taken make up the rest; which rank each actor becomes is decided over all of them by node
(`assign_bundles`), as for bundles of one group. On a GPU job a standby holds no GPU: the restart reserves a
rank bundle pinned to its node (`Reservation.hold`) and the standby drives the GPU that bundle got."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from d9d.cluster.config import CoordinatorStorage
from d9d.cluster.control.dump import STACKS_TIMEOUT_S, RankDump, dump_rank, missing
from d9d.cluster.control.health import Liveness
from d9d.cluster.control.mailbox import CommandMailbox
from d9d.cluster.control.scaling import ScalingPolicy
from d9d.cluster.control.standby import Standby, StandbyPool, StandbySite, release
from d9d.cluster.elastic import WorldPlan
from d9d.cluster.names import NAMESPACE, rank_name, wait_names_free
from d9d.cluster.placement import (
    assign_bundles,
    bundle_for,
    device_placement,
    free_capacity,
    node_capacity,
    placement_group_name,
    placement_shortfall,
)
from d9d.cluster.rank import STACKS_SIGNAL, RankActor, RankLaunch, RankNode, rank_stacks_path
from d9d.cluster.reporter import CoordinatorTransfer
from d9d.cluster.spec import JobSpec
from d9d.engine.runtime import RankRuntime

_log = logging.getLogger(__name__)


class NoResources(RuntimeError):
    """No layout of the run could be placed within `cluster.placement_timeout_s`; the message is one line
    that says what the run asks for and what the cluster has (`placement_shortfall`)."""


@dataclass
class Reservation:
    """What an attempt holds: a placement group for its cold ranks (None: every rank is a standby) and the
    standbys it took, each with its own one-bundle group (CPU jobs), or, on a GPU job, `hold`: one rank
    bundle per standby on the standby's node, whose GPU the standby drives."""

    pg: PlacementGroup | None
    standbys: list[Standby] = field(default_factory=list)
    hold: PlacementGroup | None = None


@ray.remote(num_cpus=0)
def _bundle_gpus() -> tuple[str, ...]:
    """Run in a hold bundle: which GPUs Ray gave it (a bundle's GPUs are fixed when it is reserved)."""
    return tuple(str(g) for g in ray.get_gpu_ids())


@dataclass
class Attempt:
    index: int
    plan: WorldPlan
    pg: Reservation
    resumed_from: int  # checkpoint step (0: from scratch)
    live: Liveness
    actors: list[Any] = field(default_factory=list)
    sites: list[StandbySite] = field(default_factory=list)  # GPU jobs: each rank's node and devices
    nodes: list[RankNode] = field(default_factory=list)  # each rank's node and process


class WorkerGroup:
    def __init__(
        self,
        spec: JobSpec,
        mailbox: CommandMailbox,
        scaling: ScalingPolicy,
        standby: StandbyPool | None = None,
        notice: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._spec = spec
        self._mailbox = mailbox
        self._scaling = scaling
        self._standby = standby or StandbyPool(spec)
        self._notice = notice  # the coordinator's: said on the console as it happens

    def capacity(self) -> int:
        return node_capacity(ray.nodes(), self._spec.cluster.resources)

    def free(self) -> int:
        return free_capacity(ray.available_resources(), self._spec.cluster.resources)

    def alive(self) -> frozenset[str]:
        return frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))

    async def reserve(self, target: int) -> tuple[WorldPlan, Reservation] | None:
        """A placement group for the largest valid world size ≤ target that the cluster can hold, less the
        ready standbys it takes (None: the job was stopped meanwhile)."""
        c = self._spec.cluster
        await self._standby.withdraw_pending()  # a pending standby group must not take our bundles
        capacity = self.capacity()
        candidates = self._scaling.candidates(target, capacity)
        if candidates[-1].world_size > capacity and self._notice is not None:
            # Nodes may still join (an autoscaler, a node coming back): say so now, not after the wait.
            await self._notice(
                f"waiting up to cluster.placement_timeout_s={c.placement_timeout_s:g}s for room: the run "
                f"{self._shortfall(candidates)}"
            )
        bundle = bundle_for(c.resources)
        for plan in candidates:
            standbys = self._standby.take(plan.world_size, self.alive())
            cold = plan.world_size - len(standbys)
            pg = (
                placement_group(
                    [dict(bundle) for _ in range(cold)],
                    strategy=c.placement_strategy,
                    name=placement_group_name(self._spec.run_name, uuid.uuid4().hex[:12]),
                )
                if cold
                else None
            )
            hold = (
                placement_group(
                    [dict(bundle) for _ in standbys],
                    bundle_label_selector=[{NODE_ID_LABEL_KEY: s.ready.node_id} for s in standbys],
                    name=placement_group_name(self._spec.run_name, f"hold-{uuid.uuid4().hex[:12]}"),
                )
                if standbys and c.resources.gpus
                else None
            )
            smaller_exists = plan is not candidates[-1]
            try:
                placed = all(
                    [
                        g is None or await self._placed(g, plan, smaller_exists=smaller_exists)
                        for g in (pg, hold)
                    ]
                )
            except BaseException:  # cancelled, or Ray failed: the groups must not outlive this call
                self._standby.put_back(standbys)
                self._release(Reservation(pg, hold=hold))
                raise
            if placed:
                return plan, Reservation(pg, standbys, hold)
            self._standby.put_back(standbys)
            self._release(Reservation(pg, hold=hold))
            if self._mailbox.stop:
                return None
        raise NoResources(
            f"run {self._spec.run_name} could not be placed within cluster.placement_timeout_s="
            f"{c.placement_timeout_s:g}s: it {self._shortfall(candidates)}"
        )

    def _shortfall(self, candidates: list[WorldPlan]) -> str:
        c = self._spec.cluster
        return placement_shortfall(
            ray.nodes(),
            c.resources,
            [p.world_size for p in candidates],
            available=ray.available_resources(),
            strategy=c.placement_strategy,
        )

    async def _placed(self, pg: PlacementGroup, plan: WorldPlan, *, smaller_exists: bool) -> bool:
        """Wait for `pg`; give up early when the job is stopped or, with a smaller layout to fall back
        to, when Ray reports that the alive nodes can no longer hold this one (a node was lost)."""
        ready = asyncio.ensure_future(pg.ready())
        deadline = time.monotonic() + self._spec.cluster.placement_timeout_s
        while time.monotonic() < deadline:
            done, _ = await asyncio.wait({ready}, timeout=0.5)
            if done:
                return True
            if self._mailbox.stop or (smaller_exists and self.capacity() < plan.world_size):
                break
        ready.cancel()
        return False

    def _release(self, reservation: Reservation) -> None:
        """Give a reservation back; standbys it took are killed (they may have been given a rank)."""
        for standby in reservation.standbys:
            release(standby)
        for pg in (reservation.pg, reservation.hold):
            if pg is not None:
                remove_placement_group(pg)

    async def start(self, at: Attempt) -> list[tuple[Any, RankLaunch]]:
        """Start the rank actors on their bundles (standbys taken are running already) and say how each
        joins the job."""
        spec = self._spec
        c = spec.cluster
        res = at.pg
        cold = at.plan.world_size - len(res.standbys)
        # Slots: the cold group's bundles, then the standbys; each slot's node decides its rank.
        slot_nodes: list[str] = []
        if res.pg is not None:
            table = placement_group_table(res.pg)
            slot_nodes = [table["bundles_to_node_id"][i] for i in range(cold)]
        slot_nodes += [s.ready.node_id for s in res.standbys]
        slots = assign_bundles(slot_nodes)
        for rank, slot in enumerate(slots):
            if slot >= cold:
                at.actors.append(res.standbys[slot - cold].actor)
                continue
            assert res.pg is not None  # there are cold slots
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=res.pg, placement_group_bundle_index=slot
            )
            at.actors.append(self._cold_actor(rank, strategy))
        nodes: list[RankNode] = await asyncio.wait_for(
            asyncio.gather(*[a.node.remote() for a in at.actors]), spec.init_timeout_s
        )
        if res.hold is not None:
            nodes = await self._drive_held_gpus(at, slots, cold, nodes)
        at.nodes = list(nodes)
        port: int = await at.actors[0].open_store.remote(at.plan.world_size, spec.init_timeout_s)
        placement = device_placement(nodes, gpus=c.resources.gpus > 0)
        at.sites = [
            StandbySite(n.node_id, visible)
            for n, (_, _, visible) in zip(nodes, placement, strict=True)
            if visible is not None
        ]
        return [
            (actor, self._launch(at, rank, nodes[0].ip, port, where))
            for rank, (actor, where) in enumerate(zip(at.actors, placement, strict=True))
        ]

    def _cold_actor(self, rank: int, strategy: PlacementGroupSchedulingStrategy) -> Any:
        c = self._spec.cluster
        return (
            ray.remote(RankActor)
            .options(
                name=rank_name(self._spec.run_name, rank),
                namespace=NAMESPACE,
                num_cpus=c.resources.cpus,
                num_gpus=c.resources.gpus,
                scheduling_strategy=strategy,
                max_restarts=0,
            )
            .remote(ray.get_runtime_context().current_actor)
        )

    async def _drive_held_gpus(
        self, at: Attempt, slots: list[int], cold: int, nodes: list[RankNode]
    ) -> list[RankNode]:
        """GPU job: give each standby the GPUs of its hold bundle. A standby whose CUDA started with other
        devices than its rank will see (the node's job GPUs changed since) cannot switch: a cold rank
        takes its hold bundle instead and the standby is released."""
        spec = self._spec
        c = spec.cluster
        res = at.pg
        assert res.hold is not None
        held: list[tuple[str, ...]] = await asyncio.wait_for(
            asyncio.gather(
                *[
                    _bundle_gpus.options(
                        num_gpus=c.resources.gpus,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=res.hold, placement_group_bundle_index=i
                        ),
                    ).remote()
                    for i in range(len(res.standbys))
                ]
            ),
            spec.init_timeout_s,
        )
        rank_of = {slot: rank for rank, slot in enumerate(slots)}
        nodes = list(nodes)
        for i, gpus in enumerate(held):
            nodes[rank_of[cold + i]] = dataclasses.replace(nodes[rank_of[cold + i]], gpu_ids=gpus)
        placement = device_placement(nodes, gpus=True)
        for i, standby in enumerate(res.standbys):
            rank = rank_of[cold + i]
            if placement[rank][2] == standby.ready.cuda_visible_devices:
                continue
            _log.warning(
                "run %s: the standby for rank %d started CUDA with devices %s, the rank sees %s: the rank "
                "starts cold",
                spec.run_name,
                rank,
                standby.ready.cuda_visible_devices,
                placement[rank][2],
            )
            release(standby)
            in_hold = PlacementGroupSchedulingStrategy(res.hold, placement_group_bundle_index=i)
            at.actors[rank] = self._cold_actor(rank, in_hold)
            nodes[rank] = await asyncio.wait_for(at.actors[rank].node.remote(), spec.init_timeout_s)
        return nodes

    def _launch(
        self, at: Attempt, rank: int, master_addr: str, port: int, where: tuple[int, int, str | None]
    ) -> RankLaunch:
        spec = self._spec
        c = spec.cluster
        local_rank, local_world, visible = where
        mesh_dp = spec.train.mesh.data_parallel
        transfer = (
            CoordinatorTransfer(spec.local_checkpoint_dir(rank), c.storage.chunk_mb << 20)
            if isinstance(c.storage, CoordinatorStorage)
            else None
        )
        runtime = RankRuntime(
            rank=rank,
            world_size=at.plan.world_size,
            local_rank=local_rank,
            run_dir=spec.run_dir,
            attempt=at.index,
            data_parallel_override=at.plan.data_parallel if at.plan.data_parallel != mesh_dp else None,
        )
        return RankLaunch(
            entrypoint=c.entrypoint,
            config=spec.rank_config(rank),
            runtime=runtime,
            master_addr=master_addr,
            master_port=port,
            local_world_size=local_world,
            backend="nccl" if c.resources.gpus else "gloo",
            cuda_visible_devices=visible,
            init_timeout_s=spec.init_timeout_s,
            heartbeat_interval_s=c.heartbeat_interval_s,
            command_seq=self._mailbox.delivered,
            transfer=transfer,
            rank_output=c.rank_output,
            storage_stall_s=c.storage_stall_s,
        )

    async def dump_ranks(self, at: Attempt, timeout_s: float = STACKS_TIMEOUT_S) -> dict[int, RankDump]:
        """Every rank's threads' stacks, dumped by the rank process itself (`faulthandler` on
        STACKS_SIGNAL) and read back on its node, with py-spy's dump where installed, and its flight
        recorder's last collectives. Stacks None for a rank that gave none within `timeout_s` (a frozen
        process)."""
        run_dir = self._spec.run_dir

        async def one(rank: int, node: RankNode) -> RankDump:
            strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            ref = dump_rank.options(scheduling_strategy=strategy).remote(
                node.pid, str(rank_stacks_path(run_dir, rank)), STACKS_SIGNAL, timeout_s
            )
            try:
                dump: RankDump = await asyncio.wait_for(ref, timeout_s + 5.0)
            except Exception as e:  # the node is gone, the task could not run
                _log.warning("run %s: no stacks from rank %d: %s", self._spec.run_name, rank, e)
                return RankDump(None, missing(f"the dump on its node failed: {type(e).__name__} {e}".strip()))
            return dump

        found = await asyncio.gather(*[one(r, n) for r, n in enumerate(at.nodes) if n.pid])
        ranks = [r for r, n in enumerate(at.nodes) if n.pid]
        return dict(zip(ranks, found, strict=True))

    async def teardown(self, at: Attempt) -> None:
        """Kill every rank, those that were standbys included (a survivor may be blocked in a collective
        that can never finish, so nobody is asked to exit cleanly), and give the bundles back."""
        try:
            for actor in at.actors:
                with contextlib.suppress(Exception):  # already dead
                    ray.kill(actor, no_restart=True)
            if at.actors:
                names = [rank_name(self._spec.run_name, r) for r in range(len(at.actors))]
                await asyncio.to_thread(wait_names_free, names, 30.0)
        finally:
            self._release(at.pg)
