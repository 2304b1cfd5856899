"""Expert parallelism: experts sharded over `ep_shard`, tokens exchanged by a pluggable backend."""

from d9d.parallel.expert.all_to_all import AllToAllMoECommunication, all_to_all
from d9d.parallel.expert.backend import (
    AllToAllBackendConfig,
    AutoBackendConfig,
    DeepEPBackendConfig,
    ExpertCommunicationConfig,
    build_moe_communication,
)
from d9d.parallel.expert.capacity import ExchangeCapacity
from d9d.parallel.expert.deepep import DeepEPMoECommunication, deep_ep_available
from d9d.parallel.expert.parallelize import (
    exchange_capacities,
    parallelize_expert_parallel,
    release_expert_communication,
)

__all__ = [
    "AllToAllBackendConfig",
    "AllToAllMoECommunication",
    "AutoBackendConfig",
    "DeepEPBackendConfig",
    "DeepEPMoECommunication",
    "ExchangeCapacity",
    "ExpertCommunicationConfig",
    "all_to_all",
    "build_moe_communication",
    "deep_ep_available",
    "exchange_capacities",
    "parallelize_expert_parallel",
    "release_expert_communication",
]
