"""What `d9d status RUN` prints: a short summary of a run, whatever launched it and wherever it is read from
(its live coordinator, or its files): state, step/total, loss, tokens/s, ETA, restarts and resumes, the last
error, how long it took to start, and where its checkpoints, summary, history, plot, logs and trackers are.
`d9d status --json` prints the raw record instead.

Reading files only: neither Ray nor torch is imported here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from d9d.core.storage import Location
from d9d.engine.run_files import (
    CHECKPOINTS_DIR,
    SUMMARY_FILE,
    UNRECORDED,
    RunRecord,
    newest_commit,
    state_without_end,
)
from d9d.tracking.history import HISTORY_FILE, HistorySummary, summarize_history

_LIVE = ("running", "starting", "paused", "restarting", "started", "unknown", UNRECORDED)
_ERROR_LINES = 4  # of a multi-line error (a rank's traceback): the rest is in `--json` and the rank's log


def format_duration(seconds: float) -> str:
    """`42s`, `3m05s`, `2h07m`."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass
class Overview:
    run_name: str
    state: str
    source: str  # where this was read: "coordinator at <address>", "files"
    launcher: str = "ray"
    step: int | None = None
    total_steps: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None
    restarts: int | None = None
    resumed_from: list[int] = field(default_factory=list)  # checkpoint steps the attempts started from
    error: str | None = None
    last_failure: str | None = None
    startup_s: dict[str, float] = field(default_factory=dict)  # the first attempt's start-up phases
    where: list[tuple[str, str]] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # lines of the source (a Ray job's actors)


def _eta(history: HistorySummary, state: str, total: int | None, now: float) -> float | None:
    if (
        state not in _LIVE
        or total is None
        or history.step is None
        or history.seconds_per_step is None
        or history.written_at is None
    ):
        return None
    stale = now - history.written_at > 60.0 + 10 * history.seconds_per_step
    if stale and state != "running":  # no coordinator says it is alive and nothing was written lately
        return None
    return max(0, total - history.step) * history.seconds_per_step


def latest_commit(checkpoints: Location) -> int | None:
    """The step `checkpoints/latest` names; None without one."""
    try:
        name = (checkpoints / "latest").read_text().strip()
        return int(name.rsplit("-", 1)[-1])
    except (OSError, ValueError):
        return None


def where_lines(files: Location, record: RunRecord | None) -> list[tuple[str, str]]:
    """Where the run's files are (those that exist) and its trackers, as `d9d train` prints at the end."""
    lines: list[tuple[str, str]] = [("run dir", str(files))]
    checkpoints = files / CHECKPOINTS_DIR
    try:
        if checkpoints.is_dir():
            latest = latest_commit(checkpoints)
            suffix = "" if latest is None else f" (latest commit: step {latest})"
            lines.append(("checkpoints", f"{checkpoints}{suffix}"))
        for label, path in (
            ("summary", files / SUMMARY_FILE),
            ("history", files / HISTORY_FILE),
            ("plot", files / "plots" / "training.png"),
        ):
            if path.exists():
                lines.append((label, str(path)))
        logs = files / "logs"
        if logs.is_dir() and any(logs.glob("*.log")):
            lines.append(("logs", f"{logs} (d9d logs {record.run_name if record else files.name})"))
    except OSError:
        pass
    trackers = list(record.trackers) if record is not None else []
    if not trackers and (files / "mlflow.db").exists():
        trackers = [("mlflow", f"mlflow ui --backend-store-uri sqlite:///{files / 'mlflow.db'}")]
    lines += [(kind, text) for kind, text in trackers]
    return lines


def _first_lines(text: str | None) -> str | None:
    if not text:
        return None
    lines = text.strip().splitlines()
    if len(lines) <= _ERROR_LINES:
        return "\n".join(lines)
    return "\n".join(
        [*lines[:_ERROR_LINES], f"... ({len(lines) - _ERROR_LINES} more lines: d9d status --json)"]
    )


def overview_from_files(
    record: RunRecord | None,
    files: Location,
    launch: Mapping[str, Any] | None,
    run_name: str,
    now: float | None = None,
) -> Overview:
    """A run read from its directory (or storage root): its record, this launch's summary record (None
    while the launch has not ended, or when it has none) and its history."""
    history = summarize_history(files / HISTORY_FILE)
    total = record.total_steps if record is not None else None
    commit = None
    if record is None or record.launcher == "unknown":  # no run.json: its commits say how far it got
        commit = newest_commit(files / CHECKPOINTS_DIR)
        total = commit.total_steps if commit is not None else None
    ended = launch is not None and launch.get("status") not in ("starting", "pending")
    if launch is not None and ended:
        state = str(launch.get("status") or "unknown")
    else:
        state = state_without_end(record, commit) if record is not None else UNRECORDED
    o = Overview(
        run_name=record.run_name if record is not None else run_name,
        state=state,
        source="files",
        launcher=record.launcher if record is not None else "unknown",
        total_steps=total,
    )
    o.step, o.loss, o.tokens_per_s = history.step, history.loss, history.tokens_per_s
    if commit is not None and (o.step is None or commit.step > o.step):
        o.step = commit.step
    if launch is not None:
        if ended and state not in _LIVE and isinstance(launch.get("steps"), int):
            o.step = launch["steps"]
        losses = launch.get("losses") or {}
        if ended and state not in _LIVE and launch.get("final_loss") is not None:
            o.loss = float(launch["final_loss"])
        elif ended and state not in _LIVE and losses:
            o.loss = float(losses[max(losses, key=int)])
        if launch.get("tokens_per_s") is not None and o.tokens_per_s is None:
            o.tokens_per_s = float(launch["tokens_per_s"])
        o.restarts = launch.get("restarts") if isinstance(launch.get("restarts"), int) else None
        o.resumed_from = [s for s in launch.get("resumed_from") or () if isinstance(s, int) and s > 0]
        failures = launch.get("failures") or []
        o.last_failure = str(failures[-1]) if failures else None
        o.error = launch.get("error")
        startup = launch.get("startup_s")
        if isinstance(startup, dict):
            o.startup_s = {str(k): float(v) for k, v in startup.items() if isinstance(v, int | float)}
    o.eta_s = _eta(history, state, total, time.time() if now is None else now)
    o.where = where_lines(files, record)
    return o


def format_overview(o: Overview) -> list[str]:
    """The lines of `d9d status`."""
    launcher = {
        "ray": "Ray",
        "torchrun": "torchrun",
        "process": "one process",
        "script": "a script",
        "unknown": "no run.json",
    }.get(o.launcher, o.launcher)
    lines = [f"run {o.run_name}: {o.state} ({launcher}; read from {o.source})"]

    def row(label: str, value: str) -> None:
        lines.append(f"  {(label + ':').ljust(12)} {value}")

    total = "?" if o.total_steps is None else str(o.total_steps)
    row("step", "-" if o.step is None else f"{o.step}/{total}")
    row("loss", "-" if o.loss is None else f"{o.loss:.4f}")
    if o.tokens_per_s is not None:
        row("tokens/s", f"{o.tokens_per_s:,.0f}")
    if o.state in _LIVE:
        row("ETA", "?" if o.eta_s is None else format_duration(o.eta_s))
    restarts = "-" if o.restarts is None else str(o.restarts)
    if o.resumed_from:
        restarts += f"; resumed from step {', '.join(str(s) for s in o.resumed_from)}"
    row("restarts", restarts)
    if o.startup_s:
        total_s = sum(o.startup_s.values())
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in o.startup_s.items())
        row("start-up", f"{total_s:.1f}s ({parts})")
    if o.last_failure and o.last_failure != o.error:
        row("last failure", o.last_failure.splitlines()[0])
    error = _first_lines(o.error)
    if error:
        first, *rest = error.splitlines()
        row("error", first)
        lines += [f"  {'':13}{line}" for line in rest]  # under the first line
    lines += [f"  {line}" for line in o.extra]
    for label, text in o.where:
        row(label, text)
    return lines


def overview_from_status(
    status: Any, files: Location, record: RunRecord | None, address: str, now: float | None = None
) -> Overview:
    """A run read from its live coordinator (`status`: its `JobStatus`), with tokens/s and the step rate
    from its history in `files`."""
    history = summarize_history(files / HISTORY_FILE)
    state = str(status.state.value)
    o = Overview(
        run_name=status.run_name,
        state=state,
        source=f"its coordinator at {address}",
        launcher=record.launcher if record is not None else "ray",
        step=status.step,
        total_steps=status.total_steps,
        loss=status.last_loss,
        tokens_per_s=history.tokens_per_s,
        restarts=status.restarts,
        last_failure=status.last_failure,
        error=status.error,
        startup_s=dict(status.startup),
    )
    if status.world_size:
        o.extra.append(
            f"{'ranks:':13}{status.world_size} (attempt {status.attempt}, dp {status.data_parallel})"
        )
    o.eta_s = _eta(history, state, status.total_steps, time.time() if now is None else now)
    o.where = where_lines(files, record)
    return o
