"""`cpu_affinity`: which CPUs each rank gets (pure, on described hosts), reading them from sysfs, binding a
process's threads, and the job setting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from d9d.core.cpu_affinity import (
    CpuAffinityError,
    CpuAffinityMode,
    HostTopology,
    cpu_ranges,
    cpus_for_rank,
    read_topology,
)
from d9d.engine.config import parse_config
from d9d.engine.errors import ConfigError


def _host(
    nodes: dict[int, range], *, smt: int, gpu_nodes: tuple[int, ...], allowed: set[int] | None = None
) -> HostTopology:
    """Nodes of physical cores; with `smt` 2 each core c has a sibling c + the host's core count (the
    numbering Linux gives two-socket x86 hosts)."""
    cores = sum(len(r) for r in nodes.values())
    node_cpus = {n: frozenset(c + k * cores for c in r for k in range(smt)) for n, r in nodes.items()}
    core_of = {cpu: cpu % cores for cpus in node_cpus.values() for cpu in cpus}
    every = frozenset().union(*node_cpus.values())
    return HostTopology(node_cpus, core_of, gpu_nodes, frozenset(allowed) if allowed is not None else every)


# 2 NUMA nodes of 4 cores, hyper-threaded: node 0 is CPUs 0-3 + 8-11, node 1 CPUs 4-7 + 12-15; GPUs 0, 1 on
# node 0 and GPUs 2, 3 on node 1.
TWO_NODES = _host({0: range(0, 4), 1: range(4, 8)}, smt=2, gpu_nodes=(0, 0, 1, 1))


def _cpus(
    mode: CpuAffinityMode,
    topology: HostTopology,
    gpu: int | None,
    local_rank: int = 0,
    local_world_size: int = 1,
) -> set[int]:
    binding = cpus_for_rank(mode, topology, gpu=gpu, local_rank=local_rank, local_world_size=local_world_size)
    assert binding is not None
    return set(binding.cpus)


def test_none_binds_nothing() -> None:
    assert cpus_for_rank("none", TWO_NODES, gpu=0, local_rank=0, local_world_size=4) is None


def test_node_gives_the_gpus_numa_node() -> None:
    assert _cpus("node", TWO_NODES, gpu=1) == {0, 1, 2, 3, 8, 9, 10, 11}
    assert _cpus("node", TWO_NODES, gpu=2) == {4, 5, 6, 7, 12, 13, 14, 15}


def test_exclusive_splits_the_node_by_physical_core() -> None:
    # each GPU of a node gets half its cores, with both hyper-threads of each
    assert _cpus("exclusive", TWO_NODES, gpu=0) == {0, 1, 8, 9}
    assert _cpus("exclusive", TWO_NODES, gpu=1) == {2, 3, 10, 11}
    assert _cpus("exclusive", TWO_NODES, gpu=3) == {6, 7, 14, 15}
    shares = [_cpus("exclusive", TWO_NODES, gpu=g) for g in range(4)]
    assert set().union(*shares) == set(range(16)) and sum(map(len, shares)) == 16  # disjoint, all used


def test_exclusive_uneven_split_gives_the_first_gpus_a_core_more() -> None:
    host = _host({0: range(0, 5)}, smt=1, gpu_nodes=(0, 0, 0))
    assert [_cpus("exclusive", host, gpu=g) for g in range(3)] == [{0, 1}, {2, 3}, {4}]


def test_the_process_mask_limits_every_mode() -> None:
    # a container allowed CPUs 2-5 only: node 0 keeps 2-3, and exclusive splits those two cores
    host = _host({0: range(0, 4), 1: range(4, 8)}, smt=1, gpu_nodes=(0, 0, 1, 1), allowed={2, 3, 4, 5})
    assert _cpus("node", host, gpu=0) == {2, 3}
    assert _cpus("exclusive", host, gpu=0) == {2} and _cpus("exclusive", host, gpu=1) == {3}


def test_cpu_ranks_split_the_process_cpus_by_local_rank() -> None:
    host = _host({0: range(0, 4)}, smt=2, gpu_nodes=())
    assert _cpus("node", host, gpu=None, local_rank=1, local_world_size=2) == set(range(8))
    assert _cpus("exclusive", host, gpu=None, local_rank=0, local_world_size=2) == {0, 1, 4, 5}
    assert _cpus("exclusive", host, gpu=None, local_rank=1, local_world_size=2) == {2, 3, 6, 7}


def test_impossible_bindings_are_refused_with_the_reason() -> None:
    crowded = _host({0: range(0, 2)}, smt=2, gpu_nodes=(0, 0, 0))
    with pytest.raises(CpuAffinityError, match=r"NUMA node 0 has 2 physical core\(s\) for 3 ranks"):
        cpus_for_rank("exclusive", crowded, gpu=2, local_rank=2, local_world_size=3)
    with pytest.raises(CpuAffinityError, match="GPU 4 is not among the 4"):
        cpus_for_rank("node", TWO_NODES, gpu=4, local_rank=0, local_world_size=1)
    fenced = _host({0: range(0, 2), 1: range(2, 4)}, smt=1, gpu_nodes=(1,), allowed={0, 1})
    with pytest.raises(CpuAffinityError, match="may use no CPU of NUMA node 1"):
        cpus_for_rank("node", fenced, gpu=0, local_rank=0, local_world_size=1)


def test_read_topology_from_sysfs(tmp_path: Path) -> None:
    def write(rel: str, text: str) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    write("devices/system/node/node0/cpulist", "0-1,4-5")
    write("devices/system/node/node1/cpulist", "2-3,6-7")
    write("devices/system/node/possible", "0-1")  # not a node directory: ignored
    for cpu in range(8):
        write(f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list", f"{cpu % 4},{cpu % 4 + 4}")
    write("bus/pci/devices/0000:1b:00.0/numa_node", "1")
    write("bus/pci/devices/0000:2c:00.0/numa_node", "-1")  # the platform does not say: node 0
    topology = read_topology(tmp_path, gpu_pci=("0000:1b:00.0", "0000:2c:00.0"))
    assert topology.node_cpus == {0: {0, 1, 4, 5}, 1: {2, 3, 6, 7}}
    assert topology.core_of == {0: 0, 1: 1, 2: 2, 3: 3, 4: 0, 5: 1, 6: 2, 7: 3}
    assert topology.gpu_nodes == (1, 0)
    assert topology.allowed == frozenset(os.sched_getaffinity(0))
    with pytest.raises(CpuAffinityError, match="needs Linux's sysfs"):
        read_topology(tmp_path / "elsewhere")


def test_cpu_ranges() -> None:
    assert cpu_ranges(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a process allowed two CPUs or more")
def test_bind_process_moves_its_threads_but_not_those_with_their_own_cpus() -> None:
    # In a child process: binding changes its threads for good.
    script = textwrap.dedent(
        """
        import os, threading
        from d9d.core.cpu_affinity import bind_process

        first, second = sorted(os.sched_getaffinity(0))[:2]
        ready, done = threading.Event(), threading.Event()
        tids = {}

        def wait(name, own=None):
            if own is not None:
                os.sched_setaffinity(0, own)
            tids[name] = threading.get_native_id()
            ready.set()
            done.wait()

        threads = []
        for name, own in (("before", None), ("own", {first})):
            ready.clear()
            threads.append(threading.Thread(target=wait, args=(name, own)))
            threads[-1].start()
            ready.wait()
        moved = bind_process(frozenset({second}))
        ready.clear()
        threads.append(threading.Thread(target=wait, args=("after",)))
        threads[-1].start()
        ready.wait()
        masks = {name: sorted(os.sched_getaffinity(tid)) for name, tid in tids.items()}
        others = [  # every thread that was there at binding but "own" (torch's own among them)
            sorted(os.sched_getaffinity(int(t)))
            for t in os.listdir("/proc/self/task")
            if int(t) not in (tids["own"], tids["after"])
        ]
        done.set()
        for t in threads:
            t.join()
        print(json.dumps(dict(masks, moved=moved, others=sorted(others), first=first, second=second)))
        """
    ).replace("import os,", "import json, os,")
    cmd = [sys.executable, "-c", script]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(out.stdout)
    second = seen["second"]
    assert seen["before"] == seen["after"] == [second] and all(m == [second] for m in seen["others"])
    assert seen["own"] == [seen["first"]]  # a thread that chose its CPUs keeps them
    assert seen["moved"] == len(seen["others"])  # the main thread, "before" and what torch started


def test_job_setting_is_validated() -> None:
    job = {
        "run": {"name": "x"},
        "batching": {"global_batch_size": 2, "microbatch_size": 1},
        "trainer": {"total_steps": 1},
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider"},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
    }
    assert parse_config(job).cpu_affinity.mode == "none"
    assert parse_config({**job, "cpu_affinity": {"mode": "exclusive"}}).cpu_affinity.mode == "exclusive"
    with pytest.raises(ConfigError, match=r"cpu_affinity\.mode"):
        parse_config({**job, "cpu_affinity": {"mode": "socket"}})
