"""Ray cluster layer: driver, rank actors, coordinator, restarts, job submission. The only Ray importer.

The names below are imported on first use (PEP 562): the command line's lookups (`d9d list`, `d9d status`
of a local run) read run directories through `d9d.cluster.registry` and `d9d.cluster.state` without
importing Ray or torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.cluster.client import TrainingJob, connect, disconnect
    from d9d.cluster.config import ClusterConfig, CoordinatorStorage, RankResources, SharedStorage
    from d9d.cluster.control.failure import NonRetryableError
    from d9d.cluster.spec import JobSpec, build_job, load_job
    from d9d.cluster.state import JobState, JobStatus, RunSummary

_EXPORTS = {
    "d9d.cluster.client": ("TrainingJob", "connect", "disconnect"),
    "d9d.cluster.config": ("ClusterConfig", "CoordinatorStorage", "RankResources", "SharedStorage"),
    "d9d.cluster.control.failure": ("NonRetryableError",),
    "d9d.cluster.spec": ("JobSpec", "build_job", "load_job"),
    "d9d.cluster.state": ("JobState", "JobStatus", "RunSummary"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ClusterConfig",
    "CoordinatorStorage",
    "JobSpec",
    "JobState",
    "JobStatus",
    "NonRetryableError",
    "RankResources",
    "RunSummary",
    "SharedStorage",
    "TrainingJob",
    "build_job",
    "connect",
    "disconnect",
    "load_job",
]
