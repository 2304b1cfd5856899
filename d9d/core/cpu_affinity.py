"""Binding a rank's threads to CPUs of its own: near its GPU, apart from the other ranks of the node.

Without binding, the kernel schedules every rank's threads (the training thread, the CUDA and NCCL helper
threads, the data loader, Ray's threads under `d9d train`) over all the host's CPUs. When the step is bound by
how fast the host issues work, as FSDP's multi-GPU steps are (docs/benchmarks.md), a rank whose training
thread shares a core or moves between cores falls behind, and every collective makes the others wait for it.

Modes (`cpu_affinity.mode`):

- `none`: leave the threads where the operating system puts them.
- `node`: every CPU of the NUMA node the rank's GPU is attached to (on a CPU-only rank, every CPU it may use).
- `exclusive`: that node's physical cores split evenly among the GPUs attached to it, each rank its own
  share with both hyper-threads of each core (the lowest-numbered GPUs get one core more when the split is
  uneven); on CPU-only ranks the process's CPUs split among the node's ranks by local rank.

The choice (`cpus_for_rank`) is a pure function of a `HostTopology`, which `read_topology` reads from Linux's
sysfs; `bind_process` then moves the calling thread and every thread of the process that still has the
process's original mask (threads that chose their own CPUs, like NCCL's, keep them). Threads and processes
started later inherit the binding. The same idea as torchrun's `--numa-binding`, applied by d9d itself so
that it holds for every launcher, `d9d train` on Ray included.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict

CpuAffinityMode = Literal["none", "node", "exclusive"]

_log = logging.getLogger(__name__)
_SYS = Path("/sys")


class CpuAffinityConfig(BaseModel):
    """The job's `cpu_affinity:` section (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: CpuAffinityMode = "none"


class CpuAffinityError(RuntimeError):
    """The binding cannot be chosen or applied on this host (named: the node, the GPU, the CPUs)."""


@dataclass(frozen=True)
class HostTopology:
    """What the choice reads from the host."""

    node_cpus: Mapping[int, frozenset[int]]  # logical CPUs of each NUMA node
    core_of: Mapping[int, int]  # logical CPU → its physical core (the lowest-numbered of its siblings)
    gpu_nodes: tuple[int, ...]  # NUMA node of each GPU this process sees, by CUDA index (empty on CPU)
    allowed: frozenset[int]  # the CPUs this process may run on


@dataclass(frozen=True)
class Binding:
    cpus: frozenset[int]
    where: str  # for the log: which node, which share


def cpus_for_rank(
    mode: CpuAffinityMode, topology: HostTopology, *, gpu: int | None, local_rank: int, local_world_size: int
) -> Binding | None:
    """The CPUs `mode` gives a rank (on GPU `gpu`, or a CPU-only rank when None); None for `none`."""
    if mode == "none":
        return None
    if gpu is None:
        node, cpus = None, topology.allowed
        slot, slots = local_rank, local_world_size
    else:
        if not 0 <= gpu < len(topology.gpu_nodes):
            raise CpuAffinityError(f"GPU {gpu} is not among the {len(topology.gpu_nodes)} this process sees")
        node = topology.gpu_nodes[gpu]
        if node not in topology.node_cpus:
            raise CpuAffinityError(f"GPU {gpu} is attached to NUMA node {node}, which lists no CPUs")
        cpus = topology.node_cpus[node] & topology.allowed
        peers = [g for g, n in enumerate(topology.gpu_nodes) if n == node]
        slot, slots = peers.index(gpu), len(peers)
    place = f"NUMA node {node}" if node is not None else "this process's CPUs"
    if not cpus:
        raise CpuAffinityError(f"cpu_affinity.mode {mode}: this process may use no CPU of {place}")
    match mode:
        case "node":
            return Binding(frozenset(cpus), place)
        case "exclusive":
            return _share(cpus, topology.core_of, slot, slots, place)


def _share(cpus: frozenset[int], core_of: Mapping[int, int], slot: int, slots: int, place: str) -> Binding:
    cores: dict[int, set[int]] = {}
    for cpu in sorted(cpus):
        cores.setdefault(core_of.get(cpu, cpu), set()).add(cpu)
    if len(cores) < slots:
        raise CpuAffinityError(
            f"cpu_affinity.mode exclusive: {place} has {len(cores)} physical core(s) for {slots} ranks; "
            "use mode node or none"
        )
    per, extra = divmod(len(cores), slots)
    start = slot * per + min(slot, extra)
    chosen = list(cores.values())[start : start + per + (1 if slot < extra else 0)]
    return Binding(frozenset().union(*chosen), f"{place}, share {slot + 1} of {slots}")


def _cpu_list(text: str) -> frozenset[int]:
    """`0-3,8,10-11` → {0, 1, 2, 3, 8, 10, 11} (sysfs's list format)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            out.update(range(int(low), int(high or low) + 1))
    return frozenset(out)


def read_topology(sys_root: Path = _SYS, *, gpu_pci: tuple[str, ...] = ()) -> HostTopology:
    """The host's NUMA nodes and cores from sysfs under `sys_root`, and the node of each GPU by its PCI
    address (`gpu_pci`, as `gpu_pci_addresses` gives them)."""
    nodes_dir = sys_root / "devices/system/node"
    if not nodes_dir.is_dir():
        raise CpuAffinityError(f"{nodes_dir} does not exist: cpu_affinity needs Linux's sysfs (or mode none)")
    node_cpus = {
        int(d.name[4:]): _cpu_list((d / "cpulist").read_text())
        for d in nodes_dir.iterdir()
        if d.name.startswith("node") and d.name[4:].isdigit()
    }
    core_of: dict[int, int] = {}
    for cpu in frozenset().union(*node_cpus.values()):
        siblings = sys_root / f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        core_of[cpu] = min(_cpu_list(siblings.read_text())) if siblings.exists() else cpu
    gpu_nodes = []
    for address in gpu_pci:
        node_file = sys_root / "bus/pci/devices" / address / "numa_node"
        # -1: the platform does not say (one node, typically): node 0
        gpu_nodes.append(max(int(node_file.read_text()), 0) if node_file.exists() else 0)
    return HostTopology(node_cpus, core_of, tuple(gpu_nodes), frozenset(os.sched_getaffinity(0)))


def gpu_pci_addresses() -> tuple[str, ...]:
    """The sysfs PCI address (`0000:1b:00.0`) of each GPU this process sees, by CUDA index."""
    addresses = []
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        # (fields torch's stubs do not declare)
        domain, bus, dev = p.pci_domain_id, p.pci_bus_id, p.pci_device_id  # type: ignore[attr-defined]
        addresses.append(f"{domain:04x}:{bus:02x}:{dev:02x}.0")
    return tuple(addresses)


def bind_process(cpus: frozenset[int]) -> int:
    """Bind the calling thread, and every thread of this process whose mask is still the calling thread's
    mask from before, to `cpus`; returns how many threads moved."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    moved = 1
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            if tid != threading.get_native_id() and os.sched_getaffinity(tid) == before:
                os.sched_setaffinity(tid, cpus)
                moved += 1
        except OSError:  # the thread ended meanwhile
            continue
    return moved


def apply_cpu_affinity(
    config: CpuAffinityConfig,
    device: torch.device,
    *,
    local_rank: int,
    local_world_size: int,
    log: logging.Logger | logging.LoggerAdapter[logging.Logger] = _log,
) -> Binding | None:
    """Bind this rank's process as `config` says (a no-op for mode `none`); logs what it chose to `log`."""
    if config.mode == "none":
        return None
    on_gpu = device.type == "cuda"
    topology = read_topology(gpu_pci=gpu_pci_addresses() if on_gpu else ())
    binding = cpus_for_rank(
        config.mode,
        topology,
        gpu=(device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else None,
        local_rank=local_rank,
        local_world_size=local_world_size,
    )
    assert binding is not None
    moved = bind_process(binding.cpus)
    log.info(
        "cpu_affinity %s: %d thread(s) bound to CPUs %s (%s)",
        config.mode,
        moved,
        cpu_ranges(binding.cpus),
        binding.where,
    )
    return binding


def cpu_ranges(cpus: frozenset[int]) -> str:
    """{0, 1, 2, 5} → `0-2,5` (for the log)."""
    out: list[str] = []
    for cpu in sorted(cpus):
        if out and int(out[-1].rsplit("-", 1)[-1]) == cpu - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{cpu}"
        else:
            out.append(str(cpu))
    return ",".join(out)
