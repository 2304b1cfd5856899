"""The two forms of a cluster's address every lookup command accepts (`d9d list/status/logs/stop
--address`), and what each reaches:

- a dashboard URL (`http://head:8265`): the Jobs API (runs submitted as Ray jobs) and the state API, which
  lists the live coordinators with what their `repr` says: the run, its directory and the cluster's GCS
  address (`coordinator_repr`), so a run started by a driver that has exited is found from the URL alone;
- a GCS address (`head:6379`) or Ray client address (`ray://head:10001`): `ray.init`, then the named
  coordinators themselves.

Nothing here imports Ray at module level: the commands that only read run directories stay quick.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

DEFAULT_DASHBOARD = "http://127.0.0.1:8265"
RUN_KEY = "d9d_run"  # a submitted job's metadata key naming its run
_REPR_PREFIX = "d9d-coordinator "


@dataclass(frozen=True)
class Submission:
    submission_id: str
    run_name: str
    status: str
    message: str


def is_dashboard(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def dashboard_address(address: str | None) -> str:
    """The Jobs API address: given, or RAY_API_SERVER_ADDRESS, or an http RAY_ADDRESS, or the local head."""
    if address:
        return address
    for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
        value = os.environ.get(var, "")
        if is_dashboard(value):
            return value
    return DEFAULT_DASHBOARD


def ray_address(address: str | None) -> str | None:
    """The Ray (GCS or client) address among `address` and RAY_ADDRESS; None when both are dashboards or
    absent."""
    for value in (address, os.environ.get("RAY_ADDRESS")):
        if value and not is_dashboard(value):
            return value
    return None


def given(address: str | None) -> bool:
    """Whether the user named a cluster (`--address`, RAY_ADDRESS or RAY_API_SERVER_ADDRESS): without one a
    lookup asks the local default dashboard only when the run directories do not answer."""
    return bool(address or os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_API_SERVER_ADDRESS"))


def reachable(address: str, timeout_s: float = 2.0) -> bool:
    """A TCP connect to the address's host and port: a cheap check before `ray.init` or an HTTP client,
    which wait long for a cluster that is gone."""
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.hostname is None or parts.port is None:
        return parts.hostname is not None or "://" not in address  # "auto" and the like: let Ray resolve
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except OSError:
        return False


@dataclass(frozen=True)
class LiveCoordinator:
    """A live coordinator as the state API lists it."""

    run_name: str
    run_dir: str | None
    ray_address: str | None  # the cluster's GCS address, as the coordinator saw it


def coordinator_repr(run_name: str, run_dir: str, gcs_address: str | None) -> str:
    """What a coordinator's `__repr__` returns: Ray's state API shows it (`repr_name`) to anyone holding
    the dashboard URL."""
    return _REPR_PREFIX + json.dumps({"run": run_name, "run_dir": run_dir, "gcs": gcs_address})


def parse_coordinator_repr(text: str | None) -> LiveCoordinator | None:
    if not text or not text.startswith(_REPR_PREFIX):
        return None
    try:
        data: Any = json.loads(text[len(_REPR_PREFIX) :])
        return LiveCoordinator(str(data["run"]), data.get("run_dir"), data.get("gcs"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def live_coordinators(dashboard: str, run: str | None = None) -> list[LiveCoordinator]:
    """The live coordinators (of run `run`, or all) of the cluster whose dashboard is `dashboard`, through
    Ray's state API; raises what the API raises when there is no dashboard there."""
    from ray.util.state import list_actors

    from d9d.cluster.names import NAMESPACE, coordinator_name

    filters: list[Any] = [("ray_namespace", "=", NAMESPACE), ("state", "=", "ALIVE")]
    if run is not None:
        filters.append(("name", "=", coordinator_name(run)))
    actors: list[Any] = list_actors(address=dashboard, filters=filters, detail=True, limit=10_000)
    found = []
    for actor in actors:
        name = actor.name or ""
        if not name.endswith("/coordinator"):
            continue
        live = parse_coordinator_repr(getattr(actor, "repr_name", None))
        found.append(live or LiveCoordinator(name.removesuffix("/coordinator"), None, None))
    return found
