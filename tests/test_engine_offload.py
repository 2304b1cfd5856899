"""Sleep and wake: the training state leaves the device and comes back bit for bit.

`HostOffload` on its own (views, dedup, the same Parameter objects, a following optimizer step equal to one
that never slept), then the real engine driven by SLEEP/WAKE/RESUME commands — plain and with FSDP2 shards —
against an uninterrupted run of the same config.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from d9d.core.context import DistributedContext
from d9d.engine.checkpoint import LocalRunReporter, committed_steps, step_dir_name
from d9d.engine.config import parse_config
from d9d.engine.launch import run_rank
from d9d.engine.offload import HostOffload, training_state_tensors
from d9d.engine.runtime import Command, CommandKind, MetricPoint, RankRuntime
from d9d.engine.trainer import Trainer
from tests.engine_fixtures import TinyLMProvider
from tests.harness import RankEnv, run_distributed


class _Shared(nn.Module):
    """Two parameters viewing one flat storage, as FSDP2's shards view its padded buffer."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.randn(40, dtype=torch.float64)
        self.a = nn.Parameter(flat[:24].view(4, 6))
        self.b = nn.Parameter(flat[24:36])
        self.register_buffer("scale", torch.tensor([0.5, 2.0], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.a.T).sum(-1) * self.scale[0] + self.b.sum() * self.scale[1]


def _stepped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Shared()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, torch.randn(3, 6, dtype=torch.float64))
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


def test_host_offload_empties_every_storage_and_restores_bitwise() -> None:
    model, opt = _stepped(0)
    twin_model, twin_opt = copy.deepcopy((model, opt))  # never sleeps
    params = list(model.parameters())
    tensors = training_state_tensors([model], [opt])
    before = [t.clone() for t in tensors]
    # Independent count: one flat float64 storage (40) for both parameters, one per gradient, the buffer,
    # and per parameter exp_avg, exp_avg_sq and the float32 step.
    expected = 40 * 8 + (24 + 12) * 8 + 2 * 8 + 2 * (24 + 12) * 8 + 2 * 4

    offload = HostOffload(torch.device("cpu"), page_bytes=100)  # storages span pages
    report = offload.sleep(tensors)
    assert report.offloaded_bytes == expected == offload.host_bytes
    assert not offload.host_pinned  # pinned only for a CUDA device
    assert report.device_allocated_before is None  # only measured on CUDA
    for t in training_state_tensors([model], [opt]):
        assert t.untyped_storage().nbytes() == 0, "a tensor still holds its bytes while asleep"
    with pytest.raises(RuntimeError, match="already asleep"):
        offload.sleep(tensors)

    wake = offload.wake()
    assert wake.restored_bytes == expected and offload.host_bytes == 0
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))  # the same Parameters
    assert set(opt.state) == set(params)  # the optimizer's state is still keyed by the same objects
    after = training_state_tensors([model], [opt])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert model.a.untyped_storage().data_ptr() == model.b.untyped_storage().data_ptr()  # still one storage
    with pytest.raises(RuntimeError, match="not asleep"):
        offload.wake()

    x = torch.randn(3, 6, dtype=torch.float64)
    _step(model, opt, x)
    _step(twin_model, twin_opt, x)
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_host_offload_leaves_other_devices_alone() -> None:
    kept = torch.ones(3)
    offload = HostOffload(torch.device("meta"))
    report = offload.sleep([kept])
    assert report.offloaded_bytes == 0 and kept.untyped_storage().nbytes() == 12
    offload.wake()


WIDTH = 4096


@pytest.mark.gpu
def test_sleep_frees_the_device_memory_and_wake_restores_bitwise() -> None:
    device = torch.device("cuda", 0)
    # cuBLAS keeps its workspaces in the caching allocator once a matmul ran: part of the baseline, not of
    # what the model holds.
    warm = nn.Linear(8, 8).to(device)
    warm(torch.randn(2, 8, device=device)).sum().backward()
    del warm
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)]).to(device)  # 0.5 GiB of weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, torch.randn(8, WIDTH, device=device))
    held = torch.cuda.memory_allocated(device) - allocated
    # The reference continues from a snapshot on the host: it must not count in this device's memory.
    model_snapshot = {k: v.cpu() for k, v in model.state_dict().items()}
    opt_snapshot = copy.deepcopy(opt.state_dict())
    for state in opt_snapshot["state"].values():
        for k, v in state.items():
            state[k] = v.cpu()
    before = [t.cpu() for t in training_state_tensors([model], [opt])]

    offload = HostOffload(device)
    report = offload.sleep(training_state_tensors([model], [opt]))
    assert report.device_allocated_before is not None and report.device_allocated_after is not None
    freed = report.device_allocated_before - report.device_allocated_after
    assert freed >= 0.95 * held, (freed, held)
    assert torch.cuda.memory_reserved(device) - reserved <= 0.05 * held  # the caching allocator let go
    assert offload.host_pinned

    offload.wake()
    after = [t.cpu() for t in training_state_tensors([model], [opt])]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    twin = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)]).to(device)
    twin.load_state_dict(model_snapshot)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-3)
    twin_opt.load_state_dict(opt_snapshot)
    x = torch.randn(8, WIDTH, device=device)
    _step(model, opt, x)
    _step(twin, twin_opt, x)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


# -- the engine --------------------------------------------------------------------------------------------

SLEEP_AT = 3


class FsdpTinyLMProvider(TinyLMProvider):
    """The tiny LM with its parameters sharded by FSDP2 over the data-parallel ranks."""

    def parallelize(self, module: nn.Module, ctx: DistributedContext) -> None:
        from d9d.parallel import parallelize_fsdp

        parallelize_fsdp(module, ctx.mesh_for("dense")["dp_cp_shard"])


def _config(run_dir: Path, mesh: dict[str, int], provider: str) -> dict[str, Any]:
    return {
        "run": {"name": "sleep", "dir": str(run_dir)},
        "mesh": mesh,
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 6},
        "model": {"provider": provider},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "tests.engine_fixtures:TokenCETask"},
        "optimizer": {"provider": "adamw", "options": {"lr": 1e-2, "weight_decay": 0.01}},
        "checkpointing": {"period": None, "keep_last": 5},
        "logging": {"progress_bar": "off"},
    }


def _storage_bytes(trainer: Trainer) -> list[int]:
    parts = trainer.parts
    tensors = training_state_tensors(parts.stages.modules, parts.optimizer.optimizers.values())
    return [t.untyped_storage().nbytes() for t in tensors]


class _SleepingReporter(LocalRunReporter):
    """At step SLEEP_AT: SLEEP, then (asleep) a checkpoint request, WAKE, RESUME — checking the trainer's
    state between polls."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 5, self._record)
        self.trainer: Trainer | None = None
        self.health: list[dict[str, float]] = []
        self.polls = 0
        self.awake_bytes: list[int] = []

    def _record(self, point: MetricPoint) -> None:
        if point.kind == "health":
            self.health.append(dict(point.values))

    def commands(self, step: int) -> list[Command]:
        if step != SLEEP_AT:
            return []
        trainer = self.trainer
        assert trainer is not None
        self.polls += 1
        match self.polls:
            case 1:
                self.awake_bytes = _storage_bytes(trainer)
                assert all(n > 0 for n in self.awake_bytes)
                return [Command(CommandKind.SLEEP)]
            case 2:
                assert trainer.asleep and all(n == 0 for n in _storage_bytes(trainer))
                return [Command(CommandKind.CHECKPOINT_NOW)]  # held until the wake
            case 3:
                assert not (trainer.parts.checkpointer.root / step_dir_name(SLEEP_AT)).exists()
                return [Command(CommandKind.WAKE)]
            case 4:
                assert not trainer.asleep and _storage_bytes(trainer) == self.awake_bytes
                return []  # still paused after the wake
            case 5:
                return [Command(CommandKind.RESUME)]
        return []


def _sleep_run(env: RankEnv, tmp: Path, mesh: dict[str, int], provider: str) -> None:
    raw = _config(tmp / "reference", mesh, provider)
    runtime = RankRuntime(env.rank, env.world_size, env.rank, Path(raw["run"]["dir"]))
    reference = run_rank(raw, runtime, LocalRunReporter(tmp / "reference" / "checkpoints", 5))

    config = parse_config(_config(tmp / "slept", mesh, provider))
    reporter = _SleepingReporter(config.checkpoint_dir)
    trainer = Trainer(config, DistributedContext.create(config.mesh), reporter)
    reporter.trainer = trainer
    trainer.setup()
    result = trainer.train()
    if env.rank != 0:
        return
    assert reporter.polls >= 5, "the scripted sleep never ran"
    assert result.losses == reference.losses and len(result.losses) == 6  # bitwise: floats compared exactly
    asleep = [h for h in reporter.health if "asleep" in h]
    assert [h["asleep"] for h in asleep] == [1.0, 0.0]
    assert asleep[0]["offloaded_bytes"] > 0 and asleep[1]["wake_s"] >= 0
    steps = [p.name for p in committed_steps(config.checkpoint_dir)]
    assert step_dir_name(SLEEP_AT) in steps  # the request made while asleep was saved at the wake


@pytest.mark.distributed
def test_sleep_wake_with_fsdp_shards_trains_bitwise_like_no_sleep(tmp_path: Path) -> None:
    """Two ranks, parameters and optimizer state sharded by FSDP2 (the unsharded single-rank engine runs
    the same path through the cluster client in test_cluster_engine.py)."""
    run_distributed(
        _sleep_run,
        2,
        tmp_path,
        {"data_parallel_shard": 2},
        "tests.test_engine_offload:FsdpTinyLMProvider",
        tmp_dir=tmp_path,
        timeout=120,
    )
