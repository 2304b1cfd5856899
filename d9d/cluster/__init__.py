"""Ray cluster layer: driver, rank actors, coordinator, restarts, job submission. The only Ray importer."""

from d9d.cluster.client import TrainingJob, connect, disconnect
from d9d.cluster.config import ClusterConfig, CoordinatorStorage, RankResources, SharedStorage
from d9d.cluster.control.failure import NonRetryableError
from d9d.cluster.spec import JobSpec, build_job, load_job
from d9d.cluster.state import JobState, JobStatus, RunSummary

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
