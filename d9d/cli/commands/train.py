"""`d9d train CONFIG`: run a job on Ray rank actors and follow it until it ends.

Without --address or RAY_ADDRESS a local Ray instance is started (the laptop default); inside a Ray job
(`d9d submit`) RAY_ADDRESS points at the cluster. The whole config is validated before Ray is touched.
`--dry-run` stops there: it prints the resolved config, which rank holds which mesh coordinates, the
parameter count and a memory estimate per rank, and starts nothing (no Ray, no process group).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.cluster.client import TrainingJob
    from d9d.cluster.runtime_env import RuntimeEnvConfig
    from d9d.cluster.spec import JobSpec
    from d9d.cluster.state import RunSummary


class Preempted(KeyboardInterrupt):
    """SIGTERM or SIGINT reached the driver.

    A KeyboardInterrupt because the driver spends most of its time inside Ray's waits (`ray.get`), which
    turn only a KeyboardInterrupt raised by a signal handler into an exception of their own (a new
    KeyboardInterrupt); any other exception was left pending there and surfaced as a SystemError, killing
    the driver without stopping the run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Signals:
    """The handler of SIGTERM and SIGINT while a run is followed: remembers each signal, then raises."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        raise Preempted(signum)

    def preempted(self, interrupt: KeyboardInterrupt) -> Preempted:
        """The signal behind `interrupt`: the handler's own exception, or the one a Ray wait replaced."""
        if isinstance(interrupt, Preempted):
            return interrupt
        if not self.received:
            raise interrupt  # not one of ours
        return Preempted(self.received[-1])


def follow_preemptible(job: TrainingJob, command: str) -> int:
    """Follow `job` to its end; on SIGTERM or SIGINT (a preemption, `ray job stop`, Ctrl-C) stop it at the
    next step boundary, which commits that step, within `cluster.preemption_grace_s` (a second signal
    kills the ranks at once). The exit status (`d9d.cli.exit_codes`)."""
    from d9d.cli import exit_codes
    from d9d.cluster.follow import follow

    handler = _Signals()
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            summary = follow(job)
        except KeyboardInterrupt as e:
            return _preempted(job, command, handler.preempted(e))
        code = exit_codes.of_run(job, summary)
        if code == exit_codes.PREEMPTED:  # the coordinator stopped it: Ray drained a rank's node
            _say_resume(job, command, summary)
        return code
    finally:
        for s, previous_handler in previous.items():
            signal.signal(s, previous_handler)


def _preempted(job: TrainingJob, command: str, signal_: Preempted) -> int:
    from d9d.cli import exit_codes

    grace = job.spec.cluster.preemption_grace_s
    reason = f"preempted: {signal_} to the driver"
    print(
        f"d9d {command}: {signal_}: stopping run {job.run_name} at the next step boundary, which is saved "
        f"(at most {grace:g}s; a second signal kills the ranks now)",
        file=sys.stderr,
        flush=True,
    )
    try:
        summary = job.checkpoint_and_stop(grace, reason=reason)
    except KeyboardInterrupt:  # the second signal (raised by the handler, or by a Ray wait in its place)
        print(f"d9d {command}: killing the ranks of run {job.run_name} now", file=sys.stderr, flush=True)
        job.stop(force=True, reason=f"{reason}, killed by a second signal")
        summary = job.result(timeout=30)
    if job.coordinator_lost:
        print(f"d9d {command}: {summary.error}", file=sys.stderr, flush=True)
        return exit_codes.COORDINATOR_LOST
    if summary.status == "failed":
        print(f"d9d {command}: run {job.run_name} failed: {summary.error}", file=sys.stderr, flush=True)
        return exit_codes.FAILED
    if summary.status == "finished":
        return exit_codes.FINISHED
    _say_resume(job, command, summary)
    return exit_codes.PREEMPTED


def _say_resume(job: TrainingJob, command: str, summary: RunSummary) -> None:
    print(
        f"d9d {command}: run {job.run_name} {summary.status} at step {summary.steps} "
        f"({summary.stop_reason}); `d9d resume {job.spec.run_dir}` continues it",
        file=sys.stderr,
        flush=True,
    )


def resolved_config(spec: JobSpec) -> dict[str, Any]:
    """The job as the ranks will run it: every default filled in, directories absolute."""
    return {**spec.train.model_dump(mode="json"), "cluster": spec.cluster.model_dump(mode="json")}


def dry_run(spec: JobSpec, config_path: Path) -> int:
    import yaml

    from d9d.cluster.client import preflight_job
    from d9d.engine.dry_run import dry_run as analyse
    from d9d.engine.dry_run import format_report

    preflight_job(spec)  # what a real launch checks before Ray (`TrainingJob.start` runs it there)
    plan = spec.plan(spec.initial_workers)
    report = analyse(spec.train, plan.mesh)
    print(f"# d9d train --dry-run: {config_path} is valid; resolved config:")
    print(yaml.safe_dump(resolved_config(spec), sort_keys=False, allow_unicode=True).rstrip())
    print("# layout")
    print(format_report(report))
    print("# dry run: nothing was started (no Ray, no process group, no device memory)")
    return 0


def run(args: argparse.Namespace) -> int:
    from d9d.cli import exit_codes
    from d9d.cli import main as cli
    from d9d.cluster import TrainingJob, load_job
    from d9d.cluster.auth import RayAuthRefused
    from d9d.cluster.checkpoints import RunFinished
    from d9d.cluster.client import started_from_process
    from d9d.cluster.lease import LeaseHeld
    from d9d.engine.checkpoint import CheckpointError
    from d9d.engine.config import ConfigError

    started_from_process(cli.invoked_at)  # the start-up phases count from this command's start

    overrides = list(args.overrides)
    if args.resume_from is not None:
        overrides.append(f"run.resume_from={args.resume_from}")
    try:
        spec = load_job(
            args.config,
            overrides,
            num_workers=args.num_workers,
            cpu=args.cpu,
            runtime_env=runtime_env_option(args),
        )
        if args.dry_run:
            return dry_run(spec, args.config)
    except (ConfigError, ValueError) as e:
        print(f"d9d train: {e}", file=sys.stderr)
        return 2
    if args.detach:
        spec = type(spec)(cluster=spec.cluster.model_copy(update={"detach": True}), train=spec.train)
    if args.verbose:
        spec = type(spec)(
            cluster=spec.cluster.model_copy(update={"rank_output": "forward"}), train=spec.train
        )
    try:
        job = TrainingJob(spec).start(address=args.address)
    except RunFinished as e:
        print(f"d9d train: {e}", file=sys.stderr)
        return exit_codes.FINISHED if args.finished_ok else exit_codes.ALREADY_FINISHED
    except LeaseHeld as e:  # another launch of this run is live
        print(f"d9d train: {e}", file=sys.stderr)
        return exit_codes.LIVE_LAUNCH
    except (CheckpointError, ValueError) as e:  # resume refused: identity, run.resume, damaged commits
        print(f"d9d train: {e}", file=sys.stderr)
        return 2
    except RayAuthRefused as e:  # says which cluster and what to do
        print(f"d9d train: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:  # ray.init could not join the cluster
        hint = cli.AUTH_HINT if cli.auth_refused(e) else "is it running, and is that its address?"
        print(
            f"d9d train: cannot join the Ray cluster at {args.address or 'RAY_ADDRESS'}: {e}; {hint}",
            file=sys.stderr,
        )
        return 2
    if spec.cluster.detach:
        print(f"run {spec.run_name} started (detached); follow it with TrainingJob.attach({spec.run_name!r})")
        return 0
    # `ray job stop`, a scheduler's preemption and Ctrl-C: the ranks save the step they are at and stop.
    return follow_preemptible(job, "train")


def add_override_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key by its dotted path, value parsed as YAML "
        "(e.g. --set trainer.total_steps=20 --set optimizer.options.lr=1e-4); repeatable",
    )


def runtime_env_option(args: argparse.Namespace) -> RuntimeEnvConfig | None:
    """`--runtime-env FILE` with `--runtime-env-json` merged over it (None when neither is given); both go
    over the job file's `cluster.runtime_env`."""
    from d9d.cluster.runtime_env import (
        merge_runtime_env,
        parse_runtime_env,
        parse_runtime_env_json,
        read_runtime_env,
    )

    env = None
    if args.runtime_env is not None:
        env = parse_runtime_env(read_runtime_env(args.runtime_env), "--runtime-env")
    if args.runtime_env_json is not None:
        inline = parse_runtime_env(parse_runtime_env_json(args.runtime_env_json), "--runtime-env-json")
        env = inline if env is None else merge_runtime_env(env, inline)
    return env


def add_job_options(parser: argparse.ArgumentParser) -> None:
    """What `d9d train` and `d9d submit` both take to shape the job: overrides, world size, CPU, resume,
    runtime environment."""
    add_override_option(parser)
    parser.add_argument(
        "--num-workers",
        type=int,
        help="rank actors (the world size); a value other than the mesh's changes only the data-parallel "
        "degree (default: cluster.num_workers, else the mesh's world size)",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="CPU ranks on gloo even if the config asks for GPUs"
    )
    parser.add_argument(
        "--resume-from",
        type=Path,
        metavar="PATH",
        help="a committed step directory to start this run from (same run identity; see docs/engine.md)",
    )
    parser.add_argument(
        "--runtime-env",
        type=Path,
        metavar="FILE",
        help="YAML/JSON file of Ray runtime_env keys (py_modules, working_dir, pip, env_vars, excludes), "
        "merged over the job file's cluster.runtime_env",
    )
    parser.add_argument(
        "--runtime-env-json", metavar="JSON", help="the same inline, merged over --runtime-env"
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("train", help="train on Ray rank actors (local Ray unless --address)")
    parser.add_argument("config", type=Path, help="job file: the engine config plus a `cluster:` section")
    add_job_options(parser)
    parser.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else a local instance)")
    parser.add_argument(
        "--detach", action="store_true", help="return once started; the run outlives this process"
    )
    parser.add_argument(
        "--finished-ok",
        action="store_true",
        help="exit 0 when the run has already finished (default: exit status 5, saying so)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="forward every rank's output to this console (default: <run dir>/logs/rank<r>.log)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, run the preflight and print the resolved config, each rank's mesh coordinates, the "
        "parameter count and a memory estimate per rank; start nothing",
    )
    parser.set_defaults(handler=run)
