"""Checkpoint bytes through the coordinator, per restart, with coordinator storage (no shared filesystem).

Runs the real engine (`d9d.engine.launch:run_rank`) on a local Ray instance: a small dense Qwen3 (a few
million parameters, so a step's checkpoint is tens of MB) on `--ranks` FSDP ranks, with
`cluster.storage: {kind: coordinator}`, so every rank writes to its own scratch directory. Once step
`--kill-after` is committed, rank 1 is killed; every rank restarts and resumes from that commit. Measured
from the coordinator (`Coordinator.transfer_stats`):

  - coordinator bytes per restart: what passed through the coordinator actor's own calls between the kill
    and the first step after the resume (reports, arrivals, `latest`, pickled);
  - fetched per rank: what the node store served to each rank for the resume;

and, for the code before this change (the coordinator wrote every uploaded chunk and served every
downloaded one from its own process, and a restarted rank fetched every committed file it had not written),
the same two numbers by that definition from the commit's manifest: every rank fetches every file but its
own, and all of it passes the coordinator. The run must finish with the restart, else the script fails.

    .venv/bin/python benchmarks/coordinator_storage.py --ranks 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def engine_job(name: str, run_dir: Path, scratch: Path, args: argparse.Namespace) -> dict[str, Any]:
    architecture = {
        "vocab_size": 32,
        "hidden_size": args.hidden,
        "num_layers": args.layers,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "head_dim": args.hidden // 4,
        "intermediate_size": 4 * args.hidden,
    }
    return {
        "run": {"name": name, "dir": str(run_dir)},
        "mesh": {"data_parallel_shard": args.ranks},
        "batching": {"global_batch_size": 2 * args.ranks, "microbatch_size": 1},
        "trainer": {"total_steps": args.steps},
        "model": {"provider": "qwen3", "options": {"architecture": architecture}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-3}},
        "checkpointing": {"period": 2, "keep_last": 2},
        "logging": {"progress_bar": "off", "tracker": {"kind": "null"}},
        "cluster": {
            "restart_backoff_s": 0.1,
            "storage": {"kind": "coordinator", "local_dir": str(scratch), "chunk_mb": args.chunk_mb},
        },
    }


def _wait(job: Any, predicate: Any, timeout_s: float = 600.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not predicate(status := job.status()):
        if status.state.terminal or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or stalled before the measurement: {status}")
        time.sleep(0.05)
    return status


def measure(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import ray

    from d9d.cluster import TrainingJob, build_job
    from d9d.cluster.names import NAMESPACE, coordinator_name, rank_name
    from d9d.engine.checkpoint import read_latest, read_manifest

    name = "funnel-bench"
    job = TrainingJob(build_job(engine_job(name, tmp / "run", tmp / "scratch", args))).start()
    coordinator = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
    _wait(job, lambda s: (s.latest_checkpoint_step or 0) >= args.kill_after)
    calls_before, node_before = ray.get(coordinator.transfer_stats.remote())
    commit = read_latest(tmp / "run" / "checkpoints")
    assert commit is not None
    manifest = read_manifest(commit)
    ray.kill(ray.get_actor(rank_name(name, 1), namespace=NAMESPACE))
    resumed = _wait(job, lambda s: s.restarts >= 1 and s.step > args.kill_after)
    calls_after, node_after = ray.get(coordinator.transfer_stats.remote())
    summary = job.result(timeout=600)
    if summary is None or summary.status != "finished" or summary.restarts != 1:
        raise RuntimeError(f"expected a finished run with one restart, got {summary}")

    files = manifest["files"]
    total = sum(int(f["size"]) for f in files.values())
    own = {r: sum(int(f["size"]) for f in files.values() if f["rank"] == r) for r in range(args.ranks)}
    old_fetch = {r: total - own[r] for r in range(args.ranks)}
    served_before, served_after = node_before.served_by_rank, node_after.served_by_rank
    new_fetch = {r: served_after.get(r, 0) - served_before.get(r, 0) for r in range(args.ranks)}
    return {
        "ranks": args.ranks,
        "commit_step": int(manifest["step"]),
        "resumed_at_step": resumed.step,
        "checkpoint_bytes": total,
        "checkpoint_files": len(files),
        "own_bytes_by_rank": own,
        "before": {
            "coordinator_bytes_per_restart": sum(old_fetch.values()),
            "coordinator_bytes_per_checkpoint": total,
            "fetched_by_rank": old_fetch,
        },
        "after": {
            "coordinator_bytes_per_restart": calls_after - calls_before,
            "fetched_by_rank": new_fetch,
            "node_store_bytes_written_whole_run": node_after.written_bytes,
            "coordinator_call_bytes_whole_run": calls_after,
        },
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:8.2f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=4, help="kill rank 1 once this step is committed")
    parser.add_argument("--chunk-mb", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import ray

    ray.init(address="local", num_cpus=args.ranks + 1, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="d9d-funnel-") as tmp:
            result = measure(args, Path(tmp))
    finally:
        ray.shutdown()
    before, after = result["before"], result["after"]
    files, size = result["checkpoint_files"], _mib(result["checkpoint_bytes"])
    print(f"{result['ranks']} ranks, commit of step {result['commit_step']}: {files} files, {size}")
    print(f"{'':34}{'before':>14}{'after':>14}")
    print(
        f"{'through the coordinator, restart':34}{_mib(before['coordinator_bytes_per_restart']):>14}"
        f"{_mib(after['coordinator_bytes_per_restart']):>14}"
    )
    for r in range(result["ranks"]):
        print(
            f"{f'fetched by rank {r}':34}{_mib(before['fetched_by_rank'][r]):>14}"
            f"{_mib(after['fetched_by_rank'][r]):>14}"
        )
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
