"""`TrainingJob`: start and steer a run from any Ray driver — `d9d train`, a notebook on a `ray://` client,
or a script inside the cluster. All state lives in the coordinator actor; this object is a thin handle, so
losing it (or the whole driver, with `cluster.detach: true`) does not stop training, and
`TrainingJob.attach(run_name)` picks the run up again; when the coordinator itself died, `attach` and
`TrainingJob.resume_run` start a new one from the run's journal (`d9d.cluster.control.journal`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from d9d.cluster import auth
from d9d.cluster.checkpoints import check_launch
from d9d.cluster.config import ENGINE_ENTRYPOINT
from d9d.cluster.control.journal import find_run_dir, journal_path, read_journal, spec_of
from d9d.cluster.control.metrics import StepOrder
from d9d.cluster.control.scaling import ScalingPolicy
from d9d.cluster.coordinator import Coordinator
from d9d.cluster.lease import Lease, acquire, release
from d9d.cluster.names import NAMESPACE, coordinator_name, rank_name, wait_names_free
from d9d.cluster.placement import PlacementError, node_capacity, placement_shortfall, run_placement_groups
from d9d.cluster.rank import resolve_entrypoint
from d9d.cluster.registry import register_run
from d9d.cluster.runtime_env import RuntimeEnvConfig, import_paths
from d9d.cluster.sink import build_sink
from d9d.cluster.spec import JobSpec, build_job, load_job
from d9d.cluster.state import JobState, JobStatus, RunSummary, launch_record, record_launch
from d9d.engine.config import ConfigError
from d9d.engine.preflight import preflight
from d9d.engine.runtime import Command, CommandKind, MetricPoint

_log = logging.getLogger(__name__)
COORDINATOR_LOST = "coordinator lost"

_CALL_S = 10.0  # server-side wait per long-poll call; clients loop around it


def connect(
    address: str | None = None,
    *,
    local_cpus: int = 1,
    runtime_env: RuntimeEnvConfig | Mapping[str, Any] | None = None,
) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS); with neither, start a local Ray instance big enough
    for `local_cpus` rank CPUs even on a small laptop (Ray's CPUs are a scheduling unit, not cores).

    `runtime_env` (Ray's keys, or a `RuntimeEnvConfig`) becomes the job-level runtime environment of this
    driver: every actor it creates, a run's coordinator and ranks included, gets it. Already connected, it
    changes nothing; a run's own `cluster.runtime_env` reaches its actors either way."""
    global _job_runtime_env, _started_local
    if ray.is_initialized():
        return
    plain_output_off_a_terminal()
    env = runtime_env.to_ray() if isinstance(runtime_env, RuntimeEnvConfig) else dict(runtime_env or {})
    _job_runtime_env = env
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        _join(address, env)
    else:
        auth.ray_follows_auth_mode()  # a RAY_AUTH_MODE set after `import ray` must reach the new instance too
        ray.init(
            address="local",
            num_cpus=max(os.cpu_count() or 1, local_cpus),
            include_dashboard=False,
            runtime_env=env or None,
            _system_config=_local_system_config(),
        )
        _started_local = True


# Whether Ray here is the local instance `connect` started: no node can join it, so a run it cannot hold
# is refused before anything starts (`check_placement`).
_started_local = False


def _join(address: str, env: dict[str, Any]) -> None:
    """`ray.init` at a cluster's address, sending the token at hand when the cluster may want one
    (`d9d.cluster.auth`): raises `RayAuthRefused`, one line saying what to do, when it is refused."""
    auth.use_token_at_hand()
    ray_follows = auth.ray_follows_auth_mode()
    try:
        try:
            ray.init(address=address, runtime_env=env or None)
        except ConnectionAbortedError as error:
            # Ray client (ray://): the head's proxier starts a server per client and can fail that start
            # when a process it inspects exits meanwhile (seen as psutil's NoSuchProcess under load): a
            # race inside Ray, not a property of the request, so one more try is not a blind retry.
            if "Initialization failure from server" not in str(error):
                raise
            time.sleep(1.0)
            ray.init(address=address, runtime_env=env or None)
    except ConnectionError as error:
        if auth.auth_refused(error):
            raise auth.RayAuthRefused(auth.refusal(address, ray_follows=ray_follows)) from error
        if address.startswith("ray://") and not (ray_follows and auth.wants_token()):
            # A Ray client server that wants a token does not answer a client without one: the same timeout
            # as an unreachable one.
            raise ConnectionError(
                f"{error} at {address}; is the cluster up, and is that its client port? If it uses token "
                f"authentication: {auth.advice(ray_follows=ray_follows)}"
            ) from error
        raise


def _local_system_config() -> dict[str, Any]:
    """Ray's settings for the local instance `connect` starts. Its workers run at nice 0, not Ray's 15: the
    coordinator and the ranks are the job, and at nice 15 their start-up (importing torch and the engine)
    starves on a machine busy with anything else (`D9D_RAY_WORKER_NICENESS` sets another value)."""
    return {"worker_niceness": int(os.environ.get("D9D_RAY_WORKER_NICENESS", "0"))}


def plain_output_off_a_terminal() -> None:
    """Ray prefixes the output it forwards from actors (`(Coordinator pid=...)`) with ANSI colour codes
    wherever it goes; off a terminal (a pipe, a log file, a CI log) or with NO_COLOR set they are left out.
    RAY_COLOR_PREFIX, when set, decides as Ray documents it."""
    if "RAY_COLOR_PREFIX" in os.environ:
        return
    streams = (sys.stdout, sys.stderr)
    if os.environ.get("NO_COLOR") or not all(_isatty(s) for s in streams):
        os.environ["RAY_COLOR_PREFIX"] = "0"


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # replaced or closed
        return False


def disconnect() -> None:
    """Leave the cluster (and stop the local Ray instance `connect` started)."""
    global _job_runtime_env, _started_local
    _job_runtime_env = None
    _started_local = False
    ray.shutdown()


# Where a command-line launch began (its process's start, `started_from_process`): a launch's start-up
# phases count from there; None in a notebook, where they count from `TrainingJob.start`.
launched_at: float | None = None


def process_started_at() -> float | None:
    """Wall-clock time this process started, to 10 ms on Linux (`/proc`); None where that is unknown."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        try:
            return float(psutil.Process().create_time())
        except psutil.Error:
            return None


def started_from_process(at: float | None = None) -> None:
    """Count this process's launches' start-up from the process's start (`d9d train`, `d9d resume`): the
    interpreter, the imports and the config are part of what a user waits for. `at`, when given, is where
    the command began instead (`d9d.cli.main.main` called inside a process that did other things first)."""
    global launched_at
    launched_at = at if at is not None else process_started_at()


# The job-level runtime env `connect` joined Ray with; None when Ray was initialized by someone else.
_job_runtime_env: dict[str, Any] | None = None


def _coordinator_runtime_env(env: RuntimeEnvConfig | None) -> dict[str, Any] | None:
    """The runtime env to create the coordinator with (its ranks inherit it), if it needs one of its own.

    Ray uploads local directories only for a job-level runtime env (`ray.init`); an actor's own may name
    remote URIs only. So when `connect` joined Ray with this env, the job has it already; when Ray was
    initialized before (a notebook's own `ray.init`), an env of remote parts only goes on the coordinator,
    and one with local paths must already be the job's."""
    if env is None or env.empty or _job_runtime_env == env.to_ray():
        return None
    local = env.local_fields()
    if not local:
        return env.to_ray()
    job_env = ray.get_runtime_context().runtime_env
    missing = [field for field in local if not job_env.get(field)]
    if missing:
        raise ConfigError(
            f"cluster.runtime_env: {', '.join(missing)} name local paths, which Ray uploads only for a whole "
            "driver (ray.init(runtime_env=...)), and Ray was initialized here without them: call "
            "d9d.cluster.connect(address, runtime_env=...) (or ray.init with it) before anything else, "
            "or give remote URIs"
        )
    return None


class TrainingJob:
    def __init__(
        self,
        config: JobSpec | str | Path | Mapping[str, Any],
        *,
        overrides: tuple[str, ...] | list[str] = (),
        num_workers: int | None = None,
        cpu: bool = False,
    ) -> None:
        if isinstance(config, JobSpec):
            self.spec = config
        elif isinstance(config, Mapping):
            from d9d.engine.config import apply_overrides

            self.spec = build_job(apply_overrides(dict(config), overrides), num_workers=num_workers, cpu=cpu)
        else:
            self.spec = load_job(config, overrides, num_workers=num_workers, cpu=cpu)
        self._handle: Any = None
        self._launch_id = ""
        self._lost: RunSummary | None = None  # what this driver recorded when the coordinator died
        self._lost_lock = threading.Lock()  # `status()` and `follow()` may see the death from two threads
        self._init_cursor()

    def _init_cursor(self) -> None:
        """This handle's place in the coordinator's metric buffer: one cursor, read under a lock, so that
        two threads polling one handle (a notebook's `metrics()` beside `follow`) never both get a point."""
        self._seq = 0
        self._poll_lock = threading.Lock()
        self._order = StepOrder()

    @classmethod
    def attach(
        cls, run_name: str, address: str | None = None, *, run_dir: Path | None = None, check: bool = True
    ) -> TrainingJob:
        """A handle to a run that is already going (started elsewhere, detached). When no coordinator of it
        lives (it died with its process, its node, the Ray head, or a non-detached driver), one is started
        again from the run's journal and the run resumes from its newest commit (`resume_run`); `run_dir`
        says where the run directory is when it is not `runs/<run_name>`."""
        connect(address)
        try:
            handle: Any = ray.get_actor(coordinator_name(run_name), namespace=NAMESPACE)
            spec: JobSpec = ray.get(handle.spec.remote())
        except (ValueError, RayActorError):  # none, or a dead one whose name Ray has not released yet
            return cls.resume_run(run_dir or run_name, address, check=check, run_name=run_name)
        job = cls.__new__(cls)
        job.spec = spec
        job._handle = handle
        job._launch_id = ""  # another driver's launch: it records its own end
        job._lost = None
        job._lost_lock = threading.Lock()
        job._init_cursor()  # from the start of the coordinator's buffer
        return job

    @classmethod
    def resume_run(
        cls,
        run: str | Path,
        address: str | None = None,
        *,
        detach: bool | None = None,
        check: bool = True,
        run_name: str | None = None,
    ) -> TrainingJob:
        """Start a new coordinator for a run whose coordinator died before the run ended, from the journal
        in its run directory (`run`: the run directory, or a run name under `runs/`): the job as it ran,
        continuing its attempt numbering and commit history, resuming from the newest verified commit.
        `detach` overrides `cluster.detach`; `run_name`, when given, must be the journal's run. Raises
        `RuntimeError` when there is nothing to resume."""
        directory = find_run_dir(run)
        journal = read_journal(directory)
        if journal is None:
            raise RuntimeError(
                f"{journal_path(directory)} does not exist: no coordinator ever ran there (start the run "
                "with d9d train, or name its run directory)"
            )
        if run_name is not None and journal.run_name != run_name:
            raise RuntimeError(
                f"{journal_path(directory)} is the journal of run {journal.run_name!r}, not of {run_name!r}"
            )
        if journal.ended and journal.state is not JobState.STOPPED:
            raise RuntimeError(
                f"run {journal.run_name} already ended ({journal.state.value}); nothing to resume "
                "(d9d train starts it again from its newest commit)"
            )
        spec = spec_of(journal, directory)
        if detach is not None:
            spec = JobSpec(cluster=spec.cluster.model_copy(update={"detach": detach}), train=spec.train)
        return cls(spec).start(address, check=check)

    @property
    def run_name(self) -> str:
        return self.spec.run_name

    # -- lifecycle ---------------------------------------------------------------------------------------

    def start(self, address: str | None = None, *, check: bool = True) -> TrainingJob:
        """Start the run's coordinator. With `check` (the default) the job is first checked here, before
        Ray is touched (`preflight_job`): pass False from a client that does not see the cluster's files."""
        if self._handle is not None:
            raise RuntimeError(f"run {self.run_name} was already started")
        started = launched_at or time.time()
        spec = self.spec
        if check:
            preflight_job(spec)
        check_launch(spec)  # identity, run.resume, damaged commits, finished runs: before Ray is touched
        runtime_env = spec.cluster.runtime_env
        startup = {"started": started, "launch": time.time()}  # d9d.cluster.control.startup
        connect(
            address,
            local_cpus=int(spec.max_workers * spec.cluster.resources.cpus + 0.999),
            runtime_env=runtime_env,
        )
        startup["ray"] = time.time()
        check_placement(spec)
        self._launch_id = f"{int(time.time())}-{uuid.uuid4().hex[:8]}"
        # One live launch per run (`d9d.cluster.lease`): raises LeaseHeld naming the live one.
        acquire(
            spec.run_dir,
            spec.run_name,
            self._launch_id,
            ray_address=_cluster_address(),
            coordinator_running=_coordinator_running_here,
        )
        try:
            self._create_coordinator(spec, startup)
        except BaseException:
            release(spec.run_dir, self._launch_id)
            raise
        register_run(spec, self._launch_id)  # `d9d status/logs/stop/list` find the run by its name
        return self

    def _create_coordinator(self, spec: JobSpec, startup: dict[str, float]) -> None:
        runtime_env = spec.cluster.runtime_env
        name = coordinator_name(spec.run_name)
        _release_finished(spec.run_name)
        # Ranks of an earlier launch whose coordinator died go with it, asynchronously; their names must be
        # free before this launch's ranks take them.
        wait_names_free([rank_name(spec.run_name, r) for r in range(spec.max_workers)], 30.0)
        options: dict[str, Any] = {
            "name": name,
            "namespace": NAMESPACE,
            "num_cpus": 0,
            "max_restarts": 0,
            "lifetime": "detached" if spec.cluster.detach else None,
        }
        coordinator_env = _coordinator_runtime_env(runtime_env)
        if coordinator_env is not None:
            options["runtime_env"] = coordinator_env
        head = _head_node_id()
        if head is not None:
            # The head outlives worker nodes (in coordinator-storage mode it also holds the checkpoints);
            # a hard affinity, since a busy head would otherwise see the coordinator spill to a worker.
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
        try:
            self._handle = (
                ray.remote(Coordinator)
                .options(**options)
                .remote(spec, functools.partial(build_sink, spec), self._launch_id, startup)
            )
        except ValueError as e:
            raise RuntimeError(
                f"run {spec.run_name!r} is already running (actor {name!r} in namespace {NAMESPACE!r}): "
                "attach to it with TrainingJob.attach or choose another run.name"
            ) from e
        ray.get(self._handle.start.remote())

    def status(self) -> JobStatus:
        if self._lost is not None:
            return self._lost_status()
        try:
            status: JobStatus = ray.get(self._coordinator.status.remote())
        except RayActorError as e:
            self._coordinator_lost(e)
            return self._lost_status()
        return status

    def metrics(self, timeout: float | None = None) -> Iterator[MetricPoint]:
        """New metric points as they arrive (train, eval, per-rank health, and the cluster's own under
        rank -1); ends when the job has ended and everything was delivered, or after `timeout` seconds.

        Order: each stream (one kind of values from one rank: rank 0's `train` points, rank r's `health`
        points, `eval`, ...) arrives in strictly increasing step order, each step once; the steps a restarted
        attempt trains again are not delivered a second time (the tracker records them once too). The
        points of one poll are sorted by step. Streams are not held back for each other, so a slower rank's
        points, or task metrics finished in the background, may follow a later step of another stream;
        sort by `(step, rank)` when one order over all of them matters. The cluster's events (rank -1) are
        each delivered once, at the step they concern. A fresh handle (`TrainingJob.attach`) starts from
        the beginning of the coordinator's buffer (the newest 100,000 points)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:
            wait = _CALL_S if deadline is None else max(0.0, min(_CALL_S, deadline - time.monotonic()))
            arrived, points, ended = self._poll(wait, as_received=False)
            yield from points
            if ended and not arrived:  # (a poll of replays only may deliver nothing before the end)
                return

    def poll_metrics(self, wait_s: float, *, as_received: bool = False) -> tuple[list[MetricPoint], bool]:
        """Points not seen yet by this handle (waiting up to `wait_s` for one), and whether the job ended;
        in the order `metrics()` delivers them. `as_received`: every point as the coordinator received
        it instead, the steps a restarted attempt trains again included (`follow` prints them again)."""
        _, points, ended = self._poll(wait_s, as_received)
        return points, ended

    def _poll(self, wait_s: float, as_received: bool) -> tuple[int, list[MetricPoint], bool]:
        """(how many points arrived, those to deliver, whether the job ended)."""
        if self._lost is not None:
            return 0, [], True
        with self._poll_lock:
            try:
                seq, points, ended = ray.get(self._coordinator.metrics_since.remote(self._seq, wait_s))
            except RayActorError as e:
                self._coordinator_lost(e)
                return 0, [], True
            self._seq = seq
            return len(points), points if as_received else self._order.take(points), ended

    def wait(self, step: int | None = None, timeout: float | None = None) -> JobStatus:
        """Block until `step` is completed (or, without a step, until the job ends)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _CALL_S if deadline is None else max(0.0, min(_CALL_S, deadline - time.monotonic()))
            status = self.status() if self._lost is not None else self._wait_call(step, wait)
            if status.state.terminal or (step is not None and status.step >= step):
                return status
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run_name} did not reach {step or 'the end'} within {timeout}s")

    def result(self, timeout: float | None = None) -> RunSummary:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _CALL_S if deadline is None else max(0.0, min(_CALL_S, deadline - time.monotonic()))
            summary = self._lost if self._lost is not None else self._result_call(wait)
            if summary is not None:
                return summary
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {self.run_name} did not end within {timeout}s")

    # -- commands (take effect at the next step boundary) ------------------------------------------------

    def pause(self) -> None:
        self._send(Command(CommandKind.PAUSE))

    def resume(self) -> None:
        self._send(Command(CommandKind.RESUME))

    def sleep(self) -> None:
        """Pause at the next step boundary, then move every rank's parameters, gradients and optimizer
        state to host memory (pinned on CUDA) and empty the CUDA caching allocator: the devices are free
        for something else. `status()` says `state=paused, asleep=True` once the state is on the host."""
        self._send(Command(CommandKind.SLEEP))

    def wake(self) -> None:
        """Bring a sleeping run's state back to the devices, bit for bit; the run stays paused until
        `resume()` (which also wakes a sleeping run by itself, as `stop()` does before the run ends)."""
        self._send(Command(CommandKind.WAKE))

    def checkpoint_now(self) -> None:
        self._send(Command(CommandKind.CHECKPOINT_NOW))

    def update(self, **values: Any) -> None:
        """Change settings that are safe to change live (the engine applies `lr`, ignores the rest)."""
        self._send(Command(CommandKind.UPDATE, dict(values)))

    def stop(self, *, force: bool = False, reason: str | None = None) -> None:
        """Stop at the next step boundary, where the ranks save a checkpoint of that step; `force` kills
        the ranks at once (nothing is saved). `reason` goes to the summary (`stop_reason`)."""
        if force:
            ray.get(self._coordinator.kill.remote(reason))
        else:
            self._send(Command(CommandKind.STOP, {"reason": reason} if reason else {}))

    def checkpoint_and_stop(self, grace_s: float, *, reason: str | None = None) -> RunSummary:
        """Stop at the next step boundary (a checkpoint of that step is committed) and wait for the end; if
        the ranks have not stopped within `grace_s`, kill them (the steps since the last commit are lost,
        `stop_reason` says so). The summary of the ended run; the run may have ended meanwhile."""
        deadline = time.monotonic() + grace_s
        with contextlib.suppress(RuntimeError):  # it has ended already (or it is ending)
            self.stop(reason=reason)
        try:
            return self.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            late = f"{reason or 'stop'}: not stopped within {grace_s}s, killed"
            with contextlib.suppress(RuntimeError, RayActorError):
                self.stop(force=True, reason=late)
            return self.result(timeout=30)

    def kill_rank(self, rank: int) -> None:
        """Kill one rank actor, as a crash would (failover drills, recovery benchmarks)."""
        ray.kill(ray.get_actor(rank_name(self.run_name, rank), namespace=NAMESPACE), no_restart=True)

    def close(self) -> None:
        """Let a finished detached coordinator go now instead of after `cluster.linger_s`."""
        state = self.status().state
        if not state.terminal:
            raise RuntimeError(f"run {self.run_name} is {state.value}; stop() it before closing")
        ray.kill(self._coordinator, no_restart=True)

    @property
    def _coordinator(self) -> Any:
        if self._handle is None:
            raise RuntimeError(f"run {self.run_name} is not started; call start() first")
        return self._handle

    def _send(self, command: Command) -> None:
        ray.get(self._coordinator.send.remote(command))

    def _wait_call(self, step: int | None, wait_s: float) -> JobStatus:
        try:
            status: JobStatus = ray.get(self._coordinator.wait.remote(step, wait_s))
        except RayActorError as e:
            self._coordinator_lost(e)
            return self._lost_status()
        return status

    def _result_call(self, wait_s: float) -> RunSummary | None:
        try:
            summary: RunSummary | None = ray.get(self._coordinator.result.remote(wait_s))
        except RayActorError as e:
            self._coordinator_lost(e)
            return self._lost
        return summary

    def _coordinator_lost(self, error: RayActorError) -> None:
        """The coordinator died under this driver: give the run's placement groups back (they belong to
        the driver's job, not to the dead actor) and, unless the coordinator recorded the launch's end
        before it went, record it as failed. Once, whichever thread (a `status()` beside `follow()`) saw it
        first; the others then read what it recorded."""
        with self._lost_lock:
            if self._lost is None:
                self._record_lost(error)

    def _record_lost(self, error: RayActorError) -> None:
        spec = self.spec
        removed = remove_run_placement_groups(spec.run_name)
        summary = RunSummary(
            run_name=spec.run_name,
            status=JobState.FAILED.value,
            steps=0,
            restarts=0,
            error=coordinator_lost_error(spec, error),
            launch_id=self._launch_id,
            ended_at=time.time(),
        )
        recorded = launch_record(spec.storage_root, self._launch_id) if self._launch_id else None
        if recorded is not None and JobState(recorded.status).terminal:
            # It ended and wrote its summary first (a detached coordinator lets itself go after linger_s).
            self._lost = recorded
            return
        if self._launch_id:
            record_launch(spec.storage_root, summary)
        _log.error("run %s: %s (%d placement groups removed)", spec.run_name, COORDINATOR_LOST, removed)
        self._lost = summary

    @property
    def coordinator_lost(self) -> bool:
        """The coordinator died under this handle before it recorded the run's end (`d9d resume` then
        continues the run)."""
        lost = self._lost
        return lost is not None and (lost.error or "").startswith(COORDINATOR_LOST)

    def _lost_status(self) -> JobStatus:
        lost = self._lost
        assert lost is not None
        return JobStatus(
            run_name=self.run_name,
            state=JobState(lost.status),
            step=lost.steps,
            total_steps=self.spec.train.trainer.total_steps,
            attempt=lost.restarts,
            world_size=0,
            data_parallel=0,
            restarts=lost.restarts,
            latest_checkpoint_step=None,
            last_loss=lost.final_loss,
            last_failure=lost.failures[-1] if lost.failures else None,
            error=lost.error,
        )


def coordinator_lost_error(spec: JobSpec, error: BaseException) -> str:
    """What a driver records and says when the run's coordinator died under it."""
    lines = str(error).strip().splitlines()
    why = f" ({lines[0]})" if lines else ""
    return (
        f"{COORDINATOR_LOST}: the coordinator of run {spec.run_name} died{why}; the run is not over: "
        f"`d9d resume {spec.run_dir}` continues it from its newest commit"
    )


def preflight_job(spec: JobSpec) -> None:
    """Checks on the driver that a rank would otherwise fail on, on every attempt: the entrypoint
    imports; with the built-in engine, the engine's own preflight (data files, tokenizer, model and mesh
    sizes, plug-in modules, the source checkpoint). Raises `ConfigError` naming the field or file. The
    local packages of `cluster.runtime_env` are importable meanwhile, as they will be on the ranks."""
    with import_paths(spec.cluster.runtime_env):
        _preflight_imports(spec)


def _preflight_imports(spec: JobSpec) -> None:
    entrypoint = spec.cluster.entrypoint
    try:
        resolve_entrypoint(entrypoint)  # exactly what each rank does first
    except AttributeError as e:
        raise ConfigError(f"cluster.entrypoint: {entrypoint!r} names nothing in its module: {e}") from e
    except Exception as e:  # the module, or one it imports, fails to import
        raise ConfigError(f"cluster.entrypoint: {entrypoint!r} does not import: {e!r}") from e
    if entrypoint == ENGINE_ENTRYPOINT:
        preflight(spec.train)


def check_placement(spec: JobSpec) -> None:
    """On the local instance `connect` started, refuse a run its node cannot hold (more GPUs than this
    machine has) before any actor starts, with `PlacementError` in one line. On a cluster nodes may still
    join (an autoscaler, a node coming back): there the coordinator waits `cluster.placement_timeout_s`,
    says so, and fails the run in one line when none came."""
    if not _started_local:
        return
    sizes = [p.world_size for p in ScalingPolicy.for_job(spec).plans(spec.initial_workers)]
    nodes = ray.nodes()
    if node_capacity(nodes, spec.cluster.resources) < min(sizes):
        raise PlacementError(
            f"run {spec.run_name} cannot be placed on the local Ray instance d9d started: it "
            f"{placement_shortfall(nodes, spec.cluster.resources, sizes)}; lower cluster.resources or the "
            "world size (--num-workers), or join a cluster that has them (--address)"
        )


def remove_run_placement_groups(run_name: str) -> int:
    """Remove every placement group of `run_name` still in the cluster; how many there were."""
    ids = run_placement_groups(placement_group_table(), run_name)
    for pg_id in ids:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
    return len(ids)


def _cluster_address() -> str:
    try:
        return str(ray.get_runtime_context().gcs_address or "")
    except Exception:  # a Ray client connection may not say
        return ""


def _coordinator_running_here(lease: Lease) -> bool | None:
    """Whether the coordinator holding `lease` runs in the Ray cluster this driver joined (None: the lease
    is of another cluster, which this one cannot tell about)."""
    if not lease.ray_address or lease.ray_address != _cluster_address():
        return None
    try:
        old: Any = ray.get_actor(coordinator_name(lease.run_name), namespace=NAMESPACE)
        status: JobStatus = ray.get(old.status.remote(), timeout=10)
    except (ValueError, RayActorError):
        return False
    except Exception:  # busy: assume it lives
        return True
    return not status.state.terminal


def _head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            node_id: str = node["NodeID"]
            return node_id
    return None


def _release_finished(run_name: str) -> None:
    """What an earlier launch of this run left is let go: a detached coordinator that already ended, one
    that died (its name may linger while Ray notices), and the placement groups of a coordinator that is
    gone. A coordinator still running stays (starting a second one then fails with a clear error)."""
    name = coordinator_name(run_name)
    try:
        old: Any = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        remove_run_placement_groups(run_name)
        return
    try:
        old_status: JobStatus = ray.get(old.status.remote())
        ended = old_status.state.terminal
    except RayActorError:
        ended = True
    if not ended:
        return
    with contextlib.suppress(Exception):  # already dead
        ray.kill(old, no_restart=True)
    wait_names_free([name], 30.0)
    remove_run_placement_groups(run_name)
