"""The coordinator: one async Ray actor per run that owns the job.

It reserves the placement group, starts the rank actors, and supervises them; it is the only writer to the
tracker, the authority on which checkpoint is `latest`, and the mailbox for control commands. Its
supervision loop is a plain state machine over attempts:

    reserve resources → start ranks → rendezvous → run ──finished/stopped──▶ done
                 ▲                                  │
                 └──── restart (backoff, maybe a ◀──┘ failure: actor death, missed heartbeats,
                       different DP degree)           no step boundary within the timeout, engine error;
                                                      or a resize when resources came back

A failing attempt is torn down by killing every rank actor: a survivor may be blocked in a collective that
can never finish, so nobody is asked to exit cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from d9d.cluster.checkpoints import CheckpointStore, CommittedStep
from d9d.cluster.config import CoordinatorStorage
from d9d.cluster.elastic import WorldPlan
from d9d.cluster.placement import assign_bundles, bundle_for, free_capacity, local_ranks, node_capacity
from d9d.cluster.rank import RankActor, RankLaunch, RankNode
from d9d.cluster.reporter import CoordinatorTransfer
from d9d.cluster.sink import MetricSink, MetricsWriter, ReplayFilter
from d9d.cluster.spec import JobSpec
from d9d.cluster.state import JobState, JobStatus, RunSummary, StateMachine
from d9d.engine.runtime import (
    Command,
    CommandKind,
    MetricPoint,
    RankCheckpointReport,
    RankResult,
    RankRuntime,
)

NAMESPACE = "d9d"
CLUSTER_RANK = -1  # metric points about the job itself (recovery time, world size) carry this rank
_POLL_S = 0.1
_COMMAND_POLL_S = 10.0
_METRIC_BUFFER = 100_000
_log = logging.getLogger(__name__)


def coordinator_name(run_name: str) -> str:
    return f"{run_name}/coordinator"


def rank_name(run_name: str, rank: int) -> str:
    return f"{run_name}/rank-{rank}"


class NoResources(RuntimeError):
    pass


@dataclass
class _Outcome:
    kind: Literal["finished", "stopped", "failed", "resize"]
    reason: str = ""
    workers: int = 0  # for a resize


@dataclass
class _Attempt:
    index: int
    plan: WorldPlan
    pg: PlacementGroup
    resumed_from: int  # checkpoint step (0: from scratch)
    actors: list[Any] = field(default_factory=list)
    heartbeats: dict[int, float] = field(default_factory=dict)
    progress: float = field(default_factory=time.monotonic)  # last step boundary or checkpoint call
    step_done: bool = False  # a step completed in this attempt


class Coordinator:
    """Async actor; every method runs on one event loop, blocking work goes to threads."""

    def __init__(self, spec: JobSpec, sink_factory: Callable[[], MetricSink]) -> None:
        self._spec = spec
        self._store = CheckpointStore(spec.checkpoint_dir, spec.train.checkpointing.keep_last)
        self._machine = StateMachine()
        self._changed = asyncio.Condition()
        self._writer = MetricsWriter(sink_factory)
        self._main: asyncio.Task[None] | None = None
        self._done = False  # terminal, summary written, tracker closed
        self._attempt: _Attempt | None = None
        self._attempts = 0
        # metrics
        self._metric_seq = 0
        self._buffer: deque[tuple[int, MetricPoint]] = deque(maxlen=_METRIC_BUFFER)
        self._replays = ReplayFilter()
        self._losses: dict[int, float] = {}
        self._last_step = 0
        # commands
        self._commands: list[tuple[int, Command]] = []
        self._command_seq = 0
        self._delivered_seq = 0
        self._paused = False
        self._stop = False
        self._kill = False
        self._resize_to: int | None = None
        # Alive nodes when a resize last fell short of its target (fragmented room): no new attempt to
        # grow until the set of nodes changes.
        self._grow_blocked: frozenset[str] | None = None
        # faults
        self._failures: list[str] = []
        self._failure_time: float | None = None
        self._summary = RunSummary(run_name=spec.run_name, status=JobState.PENDING.value, steps=0, restarts=0)
        self._latest_step: int | None = None

    # == client API ======================================================================================

    async def start(self) -> None:
        if self._main is None:
            self._main = asyncio.get_running_loop().create_task(self._run_job())

    async def spec(self) -> JobSpec:
        return self._spec

    async def status(self) -> JobStatus:
        at = self._attempt
        return JobStatus(
            run_name=self._spec.run_name,
            state=self._machine.state,
            step=self._last_step,
            total_steps=self._spec.train.trainer.total_steps,
            attempt=self._attempts - 1,
            world_size=at.plan.world_size if at else 0,
            data_parallel=at.plan.data_parallel if at else 0,
            restarts=max(self._attempts - 1, 0),
            latest_checkpoint_step=self._latest_step,
            last_loss=self._losses[max(self._losses)] if self._losses else None,
            last_failure=self._failures[-1] if self._failures else None,
            error=self._summary.error,
        )

    async def send(self, command: Command) -> None:
        state = self._machine.state
        if state.terminal:
            raise RuntimeError(f"run {self._spec.run_name} has already ended ({state.value})")
        if command.kind is CommandKind.PAUSE:
            self._paused = True  # the state reads `paused` once rank 0 reports that it stopped
        elif command.kind is CommandKind.RESUME:
            self._paused = False
            if state is JobState.PAUSED:
                self._machine.to(JobState.RUNNING)
            if self._attempt is not None:
                self._attempt.progress = time.monotonic()
        elif command.kind is CommandKind.STOP:
            self._stop = True
        self._command_seq += 1
        self._commands.append((self._command_seq, command))
        await self._notify()

    async def kill(self) -> None:
        """Stop now without waiting for a step boundary (ranks are killed, nothing is saved)."""
        self._stop = self._kill = True
        await self._notify()

    async def metrics_since(self, seq: int, timeout_s: float) -> tuple[int, list[MetricPoint], bool]:
        """Points after `seq` (waits up to `timeout_s` for new ones); also says whether the job ended."""
        await self._wait_until(lambda: self._metric_seq > seq or self._done, timeout_s)
        points = [p for s, p in self._buffer if s > seq]
        return self._metric_seq, points, self._done

    async def wait(self, step: int | None, timeout_s: float) -> JobStatus:
        def reached() -> bool:
            return self._machine.state.terminal or (step is not None and self._last_step >= step)

        await self._wait_until(reached, timeout_s)
        return await self.status()

    async def result(self, timeout_s: float) -> RunSummary | None:
        await self._wait_until(lambda: self._done, timeout_s)
        return self._summary if self._done else None

    # == rank API ========================================================================================

    async def report(self, attempt: int, points: list[MetricPoint]) -> None:
        if self._current(attempt):
            await self._accept(points)

    async def heartbeat(self, attempt: int, rank: int, points: list[MetricPoint]) -> None:
        if self._current(attempt):
            assert self._attempt is not None
            self._attempt.heartbeats[rank] = time.monotonic()
            await self._accept(points)

    async def boundary(self, attempt: int, step: int, points: list[MetricPoint]) -> None:
        """Rank 0 reached a step boundary (sent once per step, with the points reported since the last
        one): the job's progress signal."""
        if not self._current(attempt):
            return
        assert self._attempt is not None
        self._attempt.progress = time.monotonic()
        self._step_seen(step)
        await self._accept(points)

    async def next_commands(self, attempt: int, seq: int) -> tuple[int, list[Command]]:
        """Long poll of rank 0: commands issued after `seq`."""
        await self._wait_until(lambda: self._command_seq > seq or not self._current(attempt), _COMMAND_POLL_S)
        if not self._current(attempt):
            return seq, []
        self._delivered_seq = max(self._delivered_seq, self._command_seq)
        return self._command_seq, [c for s, c in self._commands if s > seq]

    async def checkpoint_written(self, attempt: int, report: RankCheckpointReport) -> None:
        self._require_current(attempt)
        assert self._attempt is not None
        self._attempt.progress = time.monotonic()

    async def write_chunk(
        self, attempt: int, step: int, relative_path: str, offset: int, data: list[Any]
    ) -> None:
        self._require_current(attempt)
        chunk: bytes = await data[0]
        await asyncio.to_thread(self._store.write_chunk, step, relative_path, offset, chunk)
        assert self._attempt is not None
        self._attempt.progress = time.monotonic()

    async def read_chunk(self, step: int, relative_path: str, offset: int, size: int) -> bytes:
        return await asyncio.to_thread(self._store.read_chunk, step, relative_path, offset, size)

    async def commit(self, attempt: int, step: int, reports: Sequence[RankCheckpointReport]) -> None:
        self._require_current(attempt)
        at = self._attempt
        assert at is not None
        await asyncio.to_thread(self._store.commit, step, reports, at.plan.world_size)
        at.progress = time.monotonic()
        self._latest_step = step
        self._consider_growing(at)
        await self._notify()

    async def latest(self) -> CommittedStep | None:
        return await asyncio.to_thread(self._store.latest)

    # == supervision =====================================================================================

    async def _run_job(self) -> None:
        state = JobState.FAILED
        try:
            state = await self._supervise()
        except Exception:
            self._summary.error = traceback.format_exc()
            _log.error("run %s failed:\n%s", self._spec.run_name, self._summary.error)
        finally:
            await self._teardown()
            self._finish(state)
            await asyncio.to_thread(self._writer.close, state.value)
            self._done = True
            await self._notify()
            if self._spec.cluster.detach:
                await asyncio.sleep(self._spec.cluster.linger_s)
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def _supervise(self) -> JobState:
        target = self._spec.initial_workers
        growing = False
        while True:
            if self._stop:
                return JobState.STOPPED
            self._machine.to(JobState.STARTING)
            await self._notify()
            self._attempt = await self._reserve(target)
            if self._attempt is None:
                return JobState.STOPPED
            if growing and self._attempt.plan.world_size < target:
                self._grow_blocked = _alive_nodes()
            outcome = await self._run_attempt(self._attempt)
            if outcome.kind in ("finished", "stopped"):
                await self._teardown()
                return JobState.FINISHED if outcome.kind == "finished" else JobState.STOPPED
            # The failure is known now: say so before the teardown, which waits for Ray to release the
            # dead actors (seconds after a node loss).
            growing = outcome.kind == "resize"
            if not growing:
                self._failures.append(outcome.reason)
                self._failure_time = time.monotonic()
                _log.warning("run %s attempt failed: %s", self._spec.run_name, outcome.reason)
            self._machine.to(JobState.RESTARTING)
            await self._notify()
            await self._teardown()
            if growing:
                self._summary.resizes += 1
                target = outcome.workers
                continue
            if len(self._failures) > self._spec.cluster.max_failures:
                self._summary.error = (
                    f"gave up after {len(self._failures)} failures (cluster.max_failures="
                    f"{self._spec.cluster.max_failures}); last: {outcome.reason}"
                )
                return JobState.FAILED
            c = self._spec.cluster
            backoff = min(c.restart_backoff_s * 2 ** (len(self._failures) - 1), c.max_backoff_s)
            await self._wait_until(lambda: self._stop, backoff)
            target = self._spec.initial_workers

    async def _reserve(self, target: int) -> _Attempt | None:
        """A placement group for the largest valid world size ≤ target that the cluster can hold (None:
        the job was stopped meanwhile)."""
        spec = self._spec
        plans = spec.plans(max_workers=target) if spec.elastic else [spec.plan(target)]
        capacity = node_capacity(ray.nodes(), spec.cluster.resources)
        candidates = [p for p in plans if p.world_size <= capacity] or plans[-1:]
        bundle = bundle_for(spec.cluster.resources)
        for plan in candidates:
            pg = placement_group(
                [dict(bundle) for _ in range(plan.world_size)], strategy=spec.cluster.placement_strategy
            )
            if await self._placed(pg, plan, smaller_exists=plan is not candidates[-1]):
                latest = await asyncio.to_thread(self._prepare_store)
                return _Attempt(index=self._attempts, plan=plan, pg=pg, resumed_from=latest)
            remove_placement_group(pg)
            if self._stop:
                return None
        raise NoResources(
            f"no placement group of {[p.world_size for p in candidates]} × {bundle} became ready within "
            f"cluster.placement_timeout_s={spec.cluster.placement_timeout_s}"
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
            if self._stop:
                break
            if smaller_exists and node_capacity(ray.nodes(), self._spec.cluster.resources) < plan.world_size:
                break
        ready.cancel()
        return False

    def _prepare_store(self) -> int:
        self._store.clear_uncommitted()
        latest = self._store.latest()
        return latest.step if latest is not None else 0

    async def _run_attempt(self, at: _Attempt) -> _Outcome:
        self._attempts += 1
        self._summary.world_sizes.append(at.plan.world_size)
        self._summary.resumed_from.append(at.resumed_from or None)
        self._latest_step = at.resumed_from or None
        layout: dict[str, float] = {"world_size": at.plan.world_size, "data_parallel": at.plan.data_parallel}
        await self._accept([MetricPoint(at.resumed_from, CLUSTER_RANK, layout, "health", time.time())])
        try:
            launches = await self._start_ranks(at)
        except Exception as e:
            return _Outcome("failed", f"starting ranks: {_describe(e)}")
        # Opening a tracker (an MLflow store) can take longer than starting the ranks; training begins
        # only once metric points can be written as they arrive.
        await asyncio.to_thread(self._writer.wait_ready, self._spec.init_timeout_s)
        at.progress = time.monotonic()
        if self._paused:
            await self.send(Command(CommandKind.PAUSE))
        runs = {asyncio.ensure_future(a.run.remote(launch)): r for r, (a, launch) in enumerate(launches)}
        self._machine.to(JobState.RUNNING)  # a paused job pauses at its first step boundary
        await self._notify()
        return await self._watch(at, runs)

    async def _start_ranks(self, at: _Attempt) -> list[tuple[Any, RankLaunch]]:
        spec = self._spec
        c = spec.cluster
        table = placement_group_table(at.pg)
        bundle_nodes = [table["bundles_to_node_id"][i] for i in range(at.plan.world_size)]
        bundles = assign_bundles(bundle_nodes)
        me = ray.get_runtime_context().current_actor
        actor_cls = ray.remote(RankActor)
        for rank, bundle in enumerate(bundles):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=at.pg, placement_group_bundle_index=bundle
            )
            at.actors.append(
                actor_cls.options(
                    name=rank_name(spec.run_name, rank),
                    namespace=NAMESPACE,
                    num_cpus=c.resources.cpus,
                    num_gpus=c.resources.gpus,
                    scheduling_strategy=strategy,
                    max_restarts=0,
                ).remote(me)
            )
        nodes: list[RankNode] = await asyncio.wait_for(
            asyncio.gather(*[a.node.remote() for a in at.actors]), spec.init_timeout_s
        )
        port: int = await at.actors[0].open_store.remote(at.plan.world_size, spec.init_timeout_s)
        placement = _device_placement(nodes, gpus=c.resources.gpus > 0)
        mesh_dp = spec.train.mesh.data_parallel
        launches = []
        for rank, (actor, (local_rank, local_world, visible)) in enumerate(
            zip(at.actors, placement, strict=True)
        ):
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
            launch = RankLaunch(
                entrypoint=c.entrypoint,
                config=spec.rank_config(rank),
                runtime=runtime,
                master_addr=nodes[0].ip,
                master_port=port,
                local_world_size=local_world,
                backend="nccl" if c.resources.gpus else "gloo",
                cuda_visible_devices=visible,
                init_timeout_s=spec.init_timeout_s,
                heartbeat_interval_s=c.heartbeat_interval_s,
                command_seq=self._delivered_seq,
                transfer=transfer,
            )
            launches.append((actor, launch))
        return launches

    async def _watch(self, at: _Attempt, runs: dict[asyncio.Future[Any], int]) -> _Outcome:
        spec = self._spec
        results: dict[int, RankResult] = {}
        first_done: float | None = None
        pending = set(runs)
        while True:
            done, pending = await asyncio.wait(pending, timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                rank = runs[fut]
                try:
                    results[rank] = fut.result()
                except Exception as e:
                    return _Outcome("failed", f"rank {rank}: {_describe(e)}")
            if not pending:
                final = results[0]
                self._summary.tokens_per_s = final.tokens_per_s
                self._step_seen(final.steps)
                if final.final_loss is not None and final.steps not in self._losses:
                    self._losses[final.steps] = final.final_loss
                return _Outcome("finished" if final.status == "finished" else "stopped")
            now = time.monotonic()
            if self._kill:
                return _Outcome("stopped", "killed by request")
            if results:
                first_done = first_done or now
                if now - first_done > spec.step_timeout_s:
                    missing = sorted(set(range(at.plan.world_size)) - set(results))
                    return _Outcome(
                        "failed", f"ranks {missing} did not finish {spec.step_timeout_s}s after the others"
                    )
            for rank, seen in at.heartbeats.items():
                if now - seen > spec.cluster.heartbeat_timeout_s:
                    return _Outcome("failed", f"rank {rank}: no heartbeat for {now - seen:.1f}s")
            limit = spec.step_timeout_s if at.step_done else spec.init_timeout_s
            if not self._paused and now - at.progress > limit:
                what = "step" if at.step_done else "first step (init timeout)"
                return _Outcome(
                    "failed", f"hang: no {what} completed for {now - at.progress:.1f}s (limit {limit}s)"
                )
            if self._resize_to is not None:
                workers, self._resize_to = self._resize_to, None
                return _Outcome("resize", f"growing to {workers} ranks", workers=workers)

    async def _teardown(self) -> None:
        at = self._attempt
        if at is None or not at.actors:
            if at is not None:
                remove_placement_group(at.pg)
                self._attempt = None
            return
        for actor in at.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(actor, no_restart=True)
        names = [rank_name(self._spec.run_name, r) for r in range(len(at.actors))]
        await asyncio.to_thread(_wait_names_free, names, 30.0)
        remove_placement_group(at.pg)
        self._attempt = None

    def _consider_growing(self, at: _Attempt) -> None:
        """At a commit boundary, restart bigger if the cluster now has room for a larger valid layout."""
        spec = self._spec
        if not spec.elastic or at.plan.world_size >= spec.max_workers:
            return
        if self._grow_blocked is not None and self._grow_blocked == _alive_nodes():
            return
        room = at.plan.world_size + free_capacity(ray.available_resources(), spec.cluster.resources)
        plans = spec.plans(max_workers=min(spec.max_workers, room))
        if plans and plans[0].world_size > at.plan.world_size:
            self._resize_to = plans[0].world_size

    # == bookkeeping =====================================================================================

    def _current(self, attempt: int) -> bool:
        return self._attempt is not None and self._attempt.index == attempt

    def _require_current(self, attempt: int) -> None:
        if not self._current(attempt):
            raise RuntimeError(f"attempt {attempt} is no longer the current attempt of this run")

    def _step_seen(self, step: int) -> None:
        self._last_step = max(self._last_step, step)
        at = self._attempt
        if at is None or at.step_done or step <= at.resumed_from:
            return
        at.step_done = True
        if self._failure_time is not None:
            recovery = time.monotonic() - self._failure_time
            self._failure_time = None
            self._summary.recovery_times_s.append(recovery)
            point = MetricPoint(step, CLUSTER_RANK, {"recovery_time_s": recovery}, "health", time.time())
            self._buffer_point(point)

    def _ranks_paused(self) -> None:
        """Rank 0 stopped at a step boundary; a resume sent meanwhile wins (the ranks go on at once)."""
        if self._paused and self._machine.state is JobState.RUNNING:
            self._machine.to(JobState.PAUSED)

    async def _accept(self, points: list[MetricPoint]) -> None:
        for point in points:
            if point.kind == "train" and point.rank == 0 and "loss" in point.values:
                self._losses[point.step] = float(point.values["loss"])
                self._step_seen(point.step)
            if point.kind == "health" and point.rank == 0 and "paused" in point.values:
                self._ranks_paused()
            self._buffer_point(point)
        await self._notify()

    def _buffer_point(self, point: MetricPoint) -> None:
        self._metric_seq += 1
        self._buffer.append((self._metric_seq, point))
        if point.rank == CLUSTER_RANK or self._replays.fresh(point):
            self._writer.submit(point)

    def _finish(self, state: JobState) -> None:
        if not self._machine.state.terminal:
            self._machine.to(state)
        s = self._summary
        s.status = self._machine.state.value
        s.steps = self._last_step
        s.restarts = max(self._attempts - 1, 0)
        s.failures = list(self._failures)
        s.losses = dict(sorted(self._losses.items()))
        s.final_loss = s.losses[max(s.losses)] if s.losses else None
        run_dir = self._spec.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run_summary.json").write_text(json.dumps(s.to_json(), indent=1))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout_s)


def _device_placement(nodes: Sequence[RankNode], *, gpus: bool) -> list[tuple[int, int, str | None]]:
    """(local rank, local world size, CUDA_VISIBLE_DEVICES) per rank.

    GPU ranks on one node all see that node's job GPUs, and a rank's local rank is the index of the GPU
    Ray gave it among them, so `cuda:<LOCAL_RANK>` is exactly its own device.
    """
    if not gpus:
        return [(local, size, None) for local, size in local_ranks([n.node_id for n in nodes])]
    per_node: dict[str, list[str]] = {}
    for n in nodes:
        per_node.setdefault(n.node_id, []).extend(n.gpu_ids)
    out: list[tuple[int, int, str | None]] = []
    for n in nodes:
        ids = sorted(per_node[n.node_id], key=lambda g: (len(g), g))
        out.append((ids.index(n.gpu_ids[0]), len(ids), ",".join(ids)))
    return out


def _alive_nodes() -> frozenset[str]:
    return frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def _wait_names_free(names: Sequence[str], timeout_s: float) -> None:
    """Killed actors release their names asynchronously; the next attempt reuses them."""
    deadline = time.monotonic() + timeout_s
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.05)


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"
