"""The collective flight recorder (`d9d.core.flight_recorder`): each rank's last collectives, read from the
socket it serves while its training thread is blocked, and the rank whose sequence number lags.

Real recorders on gloo (CPU) and, in the `gpu` test, NCCL; NCCL's JSON shape is also checked offline with a
recorded dump shaped as torch's `FlightRecorder::dump_json` writes it (FlightRecorderDetail.hpp)."""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from d9d.core import flight_recorder
from d9d.core.context import init_process_group
from d9d.core.flight_recorder import Collective, Group, Snapshot, lagging, parse_dump
from tests.harness import RankEnv, run_distributed


def _entry(seq: int, op: str, state: str, *, retired: bool, record: int, p2p: bool = False) -> dict[str, Any]:
    """One entry as `dump_json` writes it: every key it sets, `duration_ms` only for timed ones."""
    return {
        "record_id": record,
        "pg_id": 0,
        "process_group": ["0", "default_pg"],
        "thread_name": "pt_main_thread",
        "thread_id": "140000000000000",
        "collective_seq_id": 0 if p2p else seq,
        "p2p_seq_id": seq if p2p else 0,
        "op_id": record + 1,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": 1_700_000_000_000_000_000 + record * 1_000_000,
        "input_sizes": [[1024]],
        "input_dtypes": ["Float"],
        "output_sizes": [[1024]],
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": 0,
        "time_discovered_completed_ns": 1_700_000_000_500_000_000 if state == "completed" else 0,
        "retired": retired,
        "timeout_ms": 600000,
        "is_p2p": p2p,
    }


def _nccl_dump(entries: list[dict[str, Any]], last_enqueued: int, last_completed: int) -> dict[str, Any]:
    """`_dump_nccl_trace_json`'s document: `pg_config` names each group's global ranks as torch's
    `ranks_str` formats them, `pg_status` is keyed by the local pg id."""
    return {
        "version": "2.10",
        "comm_lib_version": "2.27.5",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {
            "0": {
                "last_enqueued_collective": str(last_enqueued),
                "last_started_collective": "-1",
                "last_completed_collective": str(last_completed),
            }
        },
        "entries": entries,
    }


def test_a_recorded_nccl_dump_names_the_rank_that_never_issued_the_collective_the_other_waits_in() -> None:
    rank0 = _nccl_dump(
        [_entry(s, "all_reduce", "completed", retired=True, record=s) for s in (1, 2, 3)]
        + [_entry(4, "all_reduce", "scheduled", retired=False, record=4)],
        last_enqueued=4,
        last_completed=3,
    )
    rank1 = _nccl_dump(
        [_entry(s, "all_reduce", "completed", retired=True, record=s) for s in (1, 2, 3)]
        + [_entry(1, "send", "started", retired=False, record=5, p2p=True)],
        last_enqueued=3,
        last_completed=3,
    )
    snaps = {}
    for rank, dump in ((0, rank0), (1, rank1)):
        collectives, groups = parse_dump(json.loads(json.dumps(dump)), "nccl")
        assert groups == {"0": Group("default_pg", (0, 1))}
        snaps[rank] = Snapshot(tuple(collectives), groups)
    assert [(c.seq, c.op, c.state) for c in snaps[0].collectives] == [
        (1, "all_reduce", "completed"),
        (2, "all_reduce", "completed"),
        (3, "all_reduce", "completed"),
        (4, "all_reduce", "scheduled"),
    ]
    assert snaps[1].collectives[-1] == Collective(
        "nccl", "0", 1, True, "send", "started", ((1024,),), ("Float",), 1_700_000_000_005_000_000
    )

    lag = lagging(snaps, [0, 1])

    assert lag.behind == (1,)
    assert lag.findings == (
        "group 0 (default_pg, nccl): rank 1 is behind, its last collective is #3 all_reduce (completed); "
        "rank 0 issued up to #4 and waits in #4 all_reduce Float[1024]",
    )
    assert lag.ranks[0] == (
        "last completed #3 all_reduce Float[1024] in group 0 (default_pg, nccl); "
        "waits in #4 all_reduce Float[1024] (scheduled) in group 0 (default_pg, nccl)"
    )
    # The pending send is listed, not compared (p2p numbers differ between the ranks by design).
    assert lag.ranks[1].endswith("waits in p2p #1 send Float[1024] (started) in group 0 (default_pg, nccl)")


def test_states_per_recorder_gloo_retires_and_nccl_times_out() -> None:
    gloo = {
        "entries": [
            dict(
                _entry(1, "all_reduce", "scheduled", retired=True, record=1), profiling_name="gloo:all_reduce"
            )
        ]
    }
    assert parse_dump(gloo, "gloo")[0][0].state == "completed"  # gloo has no events: retired = finished
    gloo["entries"][0]["retired"] = False
    assert parse_dump(gloo, "gloo")[0][0].state == "pending"
    nccl = {"entries": [_entry(7, "all_gather", "started", retired=True, record=1)]}
    assert parse_dump(nccl, "nccl")[0][0].state == "timed out"  # retired without completing
    assert parse_dump({"version": "2.10"}, "nccl") == ([], {})  # no entries key when nothing was recorded
    many = {"entries": [_entry(s, "all_reduce", "completed", retired=True, record=s) for s in range(1, 51)]}
    kept = parse_dump(many, "nccl", keep=8)[0]
    assert [c.seq for c in kept] == list(range(43, 51))


def _snap(ops: list[tuple[int, str, str]], ranks: tuple[int, ...] = ()) -> Snapshot:
    groups = {"0": Group("default_pg", ranks)} if ranks else {}
    return Snapshot(
        tuple(Collective("gloo", "0", s, False, op, st, ((4,),), ("Float",), s) for s, op, st in ops), groups
    )


def test_disagreeing_ranks_name_the_minority_and_a_collective_nobody_finishes_is_told() -> None:
    done = [(1, "all_reduce", "completed"), (2, "broadcast", "completed")]
    skipped = {
        0: _snap([*done, (3, "all_reduce", "pending")]),
        1: _snap([*done, (3, "broadcast", "pending")]),
        2: _snap([*done, (3, "all_reduce", "pending")]),
    }
    lag = lagging(skipped, [0, 1, 2])
    assert lag.behind == (1,)
    assert lag.findings == (
        "group 0 (gloo): the ranks disagree on collective #3 (rank 0 all_reduce Float[4] (pending); "
        "rank 1 broadcast Float[4] (pending); rank 2 all_reduce Float[4] (pending)): "
        "a rank skipped or added one",
    )
    two = lagging({r: skipped[r] for r in (0, 1)}, [0, 1])
    assert two.behind == () and "disagree on collective #3" in two.findings[0]  # no majority: nobody named

    stuck = {r: _snap([*done, (3, "all_reduce", "pending")]) for r in (0, 1)}
    assert lagging(stuck, [0, 1]).findings == (
        "group 0 (gloo): every rank waits in #3 all_reduce Float[4]: the collective itself does not complete "
        "(network, device)",
    )
    quiet = {r: _snap(done) for r in (0, 1)}
    assert lagging(quiet, [0, 1]).findings == ()

    # A member that recorded nothing in the group (known from its members) lags; one that gave no
    # record is only listed.
    members = {0: _snap([*done, (3, "all_reduce", "pending")], (0, 1, 2)), 1: Snapshot(), 2: None}
    lag = lagging(members, [0, 1, 2])
    assert lag.behind == (1,) and "rank 1 is behind, its last collective is none recorded" in lag.findings[0]
    assert lag.ranks[1] == "no collective recorded" and lag.ranks[2] == "no flight record (it did not answer)"


def test_snapshot_text_round_trips_and_only_its_own_format_is_read() -> None:
    snap = Snapshot(
        (Collective("nccl", "3", 9, False, "reduce_scatter", "started", ((8, 2), (4,)), ("BFloat16",), 5),),
        {"3": Group("dp_shard", (0, 2))},
        buffer_size=100,
    )
    back = Snapshot.from_json(snap.to_json())
    assert back == snap and back.collectives[0].describe() == "#9 reduce_scatter BFloat16[8, 2] +1"
    assert Snapshot.from_json(Snapshot(missing="off").to_json()).missing == "off"
    with pytest.raises(ValueError, match="not a flight-recorder snapshot"):
        Snapshot.from_json(json.dumps({"entries": []}))  # a raw torch dump is not a snapshot


def test_enable_keeps_the_recorder_on_unless_the_user_sized_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in flight_recorder.BUFFER_ENV:
        monkeypatch.delenv(name, raising=False)
    flight_recorder.enable()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "0")  # the older name, set by the user: respected
    flight_recorder.enable()
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ and flight_recorder.buffer_size() == 0
    assert flight_recorder.snapshot().missing == "the flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"


def test_fetching_from_a_process_that_serves_nothing_fails_at_once() -> None:
    start = time.monotonic()
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):  # Linux's abstract socket / a file
        flight_recorder.fetch(os.getpid(), timeout_s=5.0)  # this process serves no snapshot
    assert time.monotonic() - start < 1.0


def _lagging_rank(env: RankEnv, backend: str) -> None:
    """Rank 1 stops before the fourth all-reduce, blocked outside any collective (in a store wait), while
    rank 0 has issued it; rank 0 reads both ranks' snapshots from their sockets, then lets rank 1 go on."""
    rank = env.rank
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    store = dist.FileStore(str(env.tmp_dir / f"store-{backend}"), env.world_size)
    init_process_group(
        "nccl" if backend == "nccl" else "gloo",
        device=device if backend == "nccl" else None,
        store=store,
        rank=rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    flight_recorder.serve()
    store.set(f"pid{rank}", str(os.getpid()))
    t = torch.ones(64, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    if backend == "nccl":
        torch.cuda.synchronize(device)
    if rank == 1:
        _settled(backend)  # gloo retires a finished collective on its own thread, just after it returned
        store.set("waiting", "1")
        store.wait(["release"])  # the hang: outside any collective
        dist.all_reduce(t)
    else:
        work = dist.all_reduce(t, async_op=True)
        assert work is not None
        store.wait(["waiting"])
        snaps = {r: flight_recorder.fetch(int(store.get(f"pid{r}").decode())) for r in (0, 1)}
        lag = lagging(snaps, [0, 1])
        last = max(c.seq for c in snaps[1].collectives if c.backend == backend)
        label = f"group 0 (default_pg, {backend})"
        assert lag.behind == (1,), lag
        assert lag.findings == (
            f"{label}: rank 1 is behind, its last collective is #{last} all_reduce (completed); "
            f"rank 0 issued up to #{last + 1} and waits in #{last + 1} all_reduce Float[64]",
        ), lag
        if backend == "gloo":
            assert last == 3  # nothing else on the group: every all-reduce is numbered from 1
        store.set("release", "1")
        work.wait()
    if backend == "nccl":
        torch.cuda.synchronize(device)
    assert torch.equal(t.cpu(), torch.full((64,), 16.0))
    _settled(backend)
    if rank == 1:
        store.set("done", "1")
        store.wait(["read"])  # serving until rank 0 has read it
    else:
        store.wait(["done"])
        snaps = {r: flight_recorder.fetch(int(store.get(f"pid{r}").decode())) for r in (0, 1)}
        caught_up = lagging(snaps, [0, 1])
        assert caught_up.findings == (), caught_up  # nothing pending anywhere
        store.set("read", "1")
    dist.destroy_process_group()


def _settled(backend: str) -> None:
    """Wait until this rank's recorder shows every collective it issued as completed."""
    deadline = time.monotonic() + 10.0
    while any(not c.completed for c in flight_recorder.snapshot().collectives if c.backend == backend):
        assert time.monotonic() < deadline, flight_recorder.snapshot()
        time.sleep(0.02)


def test_a_rank_blocked_before_a_collective_is_named_from_the_gloo_recorders() -> None:
    run_distributed(_lagging_rank, 2, "gloo", timeout=60, init_process_group=False)


@pytest.mark.gpu
@pytest.mark.gpus(2)
def test_a_rank_blocked_before_a_collective_is_named_from_the_nccl_recorders() -> None:
    run_distributed(_lagging_rank, 2, "nccl", timeout=120, init_process_group=False)
