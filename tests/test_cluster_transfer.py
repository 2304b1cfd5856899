"""Coordinator storage without a funnel (d9d.cluster.transfer).

- what a restarted rank fetches (`plan_fetch`): its own files, not the other ranks' RNG state, of the other
  ranks' DCP files only the items it may share with them, everything after a world-size change;
- the rule against real DCP files written by two gloo ranks (sharded DTensors plus replicated tensors and
  plain values that DCP deduplicates across the ranks' files): each rank loads, from a directory holding
  only what the rule fetched (sparse files), exactly the state it saved;
- end to end on Ray: a rank's upload is held in the background while training goes on, the previous
  commit stays `latest`, the rank is killed mid-upload, the job resumes from the previous commit with
  losses equal bit for bit to an uninterrupted run, and through all of it only metadata passes the
  coordinator actor while the file bytes go to and from its node's store.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from d9d.cluster import TrainingJob, build_job
from d9d.cluster.checkpoints import Arrival
from d9d.cluster.names import NAMESPACE, coordinator_name, rank_name
from d9d.cluster.transfer import Need, NodeStore, Uploader, plan_fetch
from d9d.engine.checkpoint import read_latest, read_manifest, verify_manifest
from d9d.engine.checkpoint_io import read_dcp_metadata
from d9d.engine.launch import run_rank
from d9d.engine.runtime import RankResult, RankRuntime, RunReporter
from tests.cluster_fixtures import bare_engine_rank, wait_for_step
from tests.harness import RankEnv, run_distributed


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest(files: dict[str, tuple[int, int]], ranks: int) -> dict[str, Any]:
    """A manifest listing `name -> (writer rank, size)` (the hashes do not matter to the plan)."""
    return {
        "step": 4,
        "ranks": list(range(ranks)),
        "files": {n: {"rank": r, "size": s, "sha256": _sha(n.encode())} for n, (r, s) in files.items()},
    }


def _planned(needs: list[Need]) -> dict[str, object]:
    return {n.file.relative_path: "whole" if n.ranges is None else n.ranges for n in needs}


def test_plan_fetch_takes_own_files_skips_other_ranks_state_and_takes_all_after_a_resize() -> None:
    manifest = _manifest(
        {
            "engine.pt": (0, 10),
            "identity.json": (0, 5),
            "rank-00000.pt": (0, 7),
            "rank-00001.pt": (1, 7),
            "shard-00000.pt": (0, 100),  # a file the rule knows nothing about: fetched whole
            "shard-00001.pt": (1, 100),
        },
        ranks=2,
    )
    assert _planned(plan_fetch(manifest, 1, 2, None)) == {
        "engine.pt": "whole",
        "identity.json": "whole",
        "rank-00001.pt": "whole",
        "shard-00000.pt": "whole",
        "shard-00001.pt": "whole",
    }
    assert "rank-00001.pt" not in _planned(plan_fetch(manifest, 0, 2, None))
    # Another world size (an elastic restart), or none known: every file.
    for world in (3, 1, None):
        assert sorted(_planned(plan_fetch(manifest, 0, world, None))) == sorted(manifest["files"])


def test_node_store_hashes_arrivals_per_attempt_and_refuses_a_stale_attempts_chunks(tmp_path: Path) -> None:
    store = NodeStore(tmp_path, keep_last=2)
    data = bytes(range(256)) * 9
    for offset in range(0, len(data), 1000):
        store.write(3, 6, "__1_0.distcp", offset, data[offset : offset + 1000])
    arrived = store.arrived(3, 6, ["__1_0.distcp", "engine.pt"])
    assert arrived == {"__1_0.distcp": Arrival(len(data), _sha(data), True), "engine.pt": None}
    assert store.arrived(2, 6, ["__1_0.distcp"]) == {"__1_0.distcp": None}  # another attempt's file
    # A killed rank of attempt 2 still delivering its last chunk: refused, the file stays attempt 3's.
    with pytest.raises(RuntimeError, match="attempt 2 is no longer the current attempt"):
        store.write(2, 6, "__1_0.distcp", 0, b"stale")
    assert (tmp_path / "step-00000006" / "__1_0.distcp").read_bytes() == data
    assert store.read(1, 6, "__1_0.distcp", 1000, 500) == data[1000:1500]
    assert store.stats().served_by_rank == {1: 500} and store.stats().written_bytes == len(data)


def test_uploader_raises_a_failed_upload_at_the_next_wait_and_sends_nothing_after_it() -> None:
    ran: list[int] = []

    def fail() -> None:
        raise OSError("connection reset")

    uploads = Uploader()
    uploads.submit(lambda: ran.append(1))
    uploads.submit(fail)
    uploads.submit(lambda: ran.append(3))  # the step after a failed upload can never commit
    with pytest.raises(RuntimeError, match="background checkpoint upload failed: connection reset"):
        uploads.wait()
    with pytest.raises(RuntimeError, match="connection reset"):
        uploads.close()
    assert ran == [1]


# -- the rule against real DCP files ----------------------------------------------------------------------


def _state(mesh: Any, rank: int, fill: bool) -> dict[str, Any]:
    """A training-like state: sharded parameters and moments, replicated scalars and a replicated vector,
    a plain value. `fill=False` gives the same layout with other values (what a load must overwrite)."""
    g = torch.Generator().manual_seed(7)
    full_w = torch.randn(8, 6, generator=g)
    full_m = torch.randn(16, generator=g)
    bias = torch.randn(40, generator=g)
    scale = 1.0 if fill else 0.0
    return {
        "w": distribute_tensor(full_w * scale, mesh, [Shard(0)]),
        "m": distribute_tensor(full_m * scale, mesh, [Shard(0)]),
        "step_w": torch.tensor(5.0 * scale),
        "step_m": torch.tensor(5.0 * scale),
        "bias": bias * scale,
        "lr": 0.5 if fill else 0.0,
    }


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in state.items()}


def _sparse_copy(source: Path, target: Path, need: Need) -> None:
    """What `Fetcher` leaves for a ranged need: the file at its size, only the ranges filled in."""
    data = (source / need.file.relative_path).read_bytes()
    with (target / need.file.relative_path).open("wb") as out:
        if need.ranges is None:
            out.write(data)
            return
        out.truncate(len(data))
        for offset, length in need.ranges:
            out.seek(offset)
            out.write(data[offset : offset + length])


def _dcp_rank(env: RankEnv) -> None:
    mesh = init_device_mesh("cpu", (env.world_size,))
    saved = env.tmp_dir / "saved"
    dcp.save(_state(mesh, env.rank, fill=True), checkpoint_id=str(saved))
    dist.barrier()
    # The manifest the commit would write: each file with the rank that reported it.
    files = {
        p.name: (0 if p.name == ".metadata" else int(p.name.split("_")[2]), p.stat().st_size)
        for p in saved.iterdir()
    }
    manifest = _manifest(files, env.world_size)
    needs = plan_fetch(manifest, env.rank, env.world_size, read_dcp_metadata(saved / ".metadata"))
    planned = _planned(needs)
    own = f"__{env.rank}_0.distcp"
    other = f"__{1 - env.rank}_0.distcp"
    assert planned[own] == "whole" and planned[".metadata"] == "whole"
    # Of the other rank's file only what DCP stored once for both ranks, never that rank's own shards.
    if other in planned:
        assert planned[other] != "whole"
        assert sum(n for _, n in planned[other]) < files[other][1]  # type: ignore[union-attr]
    local = env.tmp_dir / f"rank{env.rank}"
    local.mkdir()
    for need in needs:
        _sparse_copy(saved, local, need)
    # DCP stored the replicated items once, in one of the files: some rank's load below reads ranges of a
    # sparse file (a rank whose partner's file holds nothing it shares does not fetch that file at all).
    shared = torch.tensor([int(other in planned)])
    dist.all_reduce(shared)
    assert int(shared) >= 1

    loaded = _state(mesh, env.rank, fill=False)
    dcp.load(loaded, checkpoint_id=str(local))
    expected = _plain(_state(mesh, env.rank, fill=True))
    got = _plain(loaded)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_sparse_fetch_of_real_dcp_files_loads_exactly_what_each_rank_saved(tmp_path: Path) -> None:
    run_distributed(_dcp_rank, 2, tmp_dir=tmp_path, timeout=60)


# -- end to end on Ray, with the real engine ---------------------------------------------------------------

_HELD_STEP = 4
_STEPS = 6


def _engine_job(run_dir: Path) -> dict[str, Any]:
    architecture = {
        "vocab_size": 32,
        "hidden_size": 128,
        "num_layers": 1,
        "num_attention_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 64,
        "intermediate_size": 512,
    }
    return {
        "run": {"name": "funnel", "dir": str(run_dir)},
        "mesh": {"data_parallel_shard": 2},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": _STEPS},
        "model": {"provider": "qwen3", "options": {"architecture": architecture}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3, "weight_decay": 0.01}},
        "checkpointing": {"period": 2, "keep_last": 3},
        "logging": {"progress_bar": "off", "tracker": {"kind": "null"}},
    }


def held_upload_rank(config: dict[str, Any], runtime: RankRuntime, reporter: RunReporter) -> RankResult:
    """The engine's rank, except that rank 1 of the first attempt never finishes uploading step 4: its
    upload thread blocks there (as on a stuck network) while the rank trains on."""
    if runtime.rank == 1 and runtime.attempt == 0:
        upload = reporter._upload  # type: ignore[attr-defined]
        never = threading.Event()

        def held(store: Any, report: Any) -> None:
            if report.step == _HELD_STEP:
                never.wait()
            upload(store, report)

        reporter._upload = held  # type: ignore[attr-defined]
    return run_rank(config, runtime, reporter)


@pytest.mark.ray
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("_ray")
def test_a_rank_killed_mid_upload_resumes_exactly_fetching_only_what_it_reads(tmp_path: Path) -> None:
    run_distributed(bare_engine_rank, 2, _engine_job(tmp_path / "bare"), timeout=120)
    reference = torch.load(tmp_path / "bare" / "losses.pt")

    scratch = tmp_path / "scratch"
    job = {
        **_engine_job(tmp_path / "run"),
        "cluster": {
            "entrypoint": "tests.test_cluster_transfer:held_upload_rank",
            "restart_backoff_s": 0.1,
            "storage": {"kind": "coordinator", "local_dir": str(scratch), "chunk_mb": 1},
        },
    }
    tj = TrainingJob(build_job(job)).start()
    coordinator = ray.get_actor(coordinator_name("funnel"), namespace=NAMESPACE)
    wait_for_step(tj, _HELD_STEP + 1)
    # Rank 1 trains past step 4 while its upload of step 4 hangs: the step is not committed.
    status = tj.status()
    assert status.step >= _HELD_STEP + 1 and status.latest_checkpoint_step == _HELD_STEP - 2
    root = tmp_path / "run" / "checkpoints"
    previous = read_latest(root)
    assert previous is not None and previous.name.endswith(f"{_HELD_STEP - 2:08d}")
    calls_before, _ = ray.get(coordinator.transfer_stats.remote())
    ray.kill(ray.get_actor(rank_name("funnel", 1), namespace=NAMESPACE))

    # Every rank restarted from the previous commit, which each still held its own files of (rank 1's
    # upload of step 4 never ended, so its step-2 files were never dropped). Of the other rank's files
    # they fetched only what they read: no optimizer or parameter shard, no RNG state.
    wait_for_step(tj, _HELD_STEP - 1)
    calls_after, node = ray.get(coordinator.transfer_stats.remote())
    manifest = read_manifest(previous)["files"]
    others = {r: sum(f["size"] for f in manifest.values() if f["rank"] != r) for r in (0, 1)}
    metadata = read_dcp_metadata(previous / ".metadata")
    sharded = [  # the bytes of every chunk of a tensor saved in pieces, by file
        (info.relative_path, info.length)
        for index, info in (metadata.storage_data or {}).items()
        if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata)
        and len(metadata.state_dict_metadata[index.fqn].chunks) > 1  # type: ignore[union-attr]
    ]
    assert set(node.served_by_rank) <= {0, 1}
    for r in (0, 1):
        their_shards = sum(n for name, n in sharded if name != f"__{r}_0.distcp")
        assert their_shards > others[r] // 2  # the other rank's files are mostly its shards
        assert node.served_by_rank.get(r, 0) <= others[r] - their_shards, (r, node.served_by_rank, others)
        local = scratch / "funnel" / f"rank-{r:05d}" / previous.name
        assert not (local / f"rank-{1 - r:05d}.pt").exists()
    summary = tj.result(timeout=180)

    assert summary.status == "finished", summary.error
    assert summary.restarts == 1 and summary.resumed_from[1] == _HELD_STEP - 2
    assert [summary.losses[s] for s in range(1, _STEPS + 1)] == reference
    latest = read_latest(root)
    assert latest is not None and latest.name.endswith(f"{_STEPS:08d}")
    verify_manifest(latest)
    # What passed the coordinator actor itself for the restart is metadata (the commit's file list, the
    # node store's handle), against the megabytes the old coordinator wrote and served from its process.
    shard = max(f["size"] for f in manifest.values())
    assert calls_after - calls_before < shard // 10, (calls_after - calls_before, shard)
    assert node.written_bytes >= sum(f["size"] for f in manifest.values())
