"""A toy engine for the cluster tests: small, deterministic on CPU, and honest about distribution.

`toy_run_rank` follows the engine contract (d9d.engine.runtime) the way the real engine does, with a
model small enough that a whole Ray test takes seconds:

- linear regression trained with SGD + momentum, gradients summed with a real gloo all-reduce;
- global sample i is a pure function of i; step s consumes global samples [s*G, (s+1)*G) and data-parallel
  rank d takes its contiguous slice, in microbatches (so a smaller DP degree means more accumulation and the
  same global batch); the next sample index comes from the checkpointed data position, not from the step;
- checkpoints are sharded: every rank writes its slice of the parameters and optimizer state (resharded on
  load when the DP degree changed), rank 0 adds the step and data position; the commit goes through the
  reporter exactly as the contract says;
- rank 0 polls commands at every step boundary and broadcasts them;
- every rank logs the sample indices it trained on to `<run dir>/samples/`, so tests can prove that no
  sample was skipped or repeated;
- faults can be injected from the config (hang, crash while writing a checkpoint, raise, raise an error
  that is not retryable).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import psutil
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field

from d9d.core.inflight import storage_operation
from d9d.engine.checkpoint import LocalRunReporter, step_dir_name
from d9d.engine.config import parse_config
from d9d.engine.runtime import (
    CheckpointFile,
    Command,
    CommandKind,
    MetricPoint,
    RankCheckpointReport,
    RankResult,
    RankRuntime,
    RunReporter,
)

if TYPE_CHECKING:
    from d9d.cluster.client import TrainingJob
    from tests.harness import RankEnv


class _Opts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Fault(_Opts):
    kind: Literal[
        "hang",
        "exit_in_checkpoint",
        "raise",
        "raise_non_retryable",
        "enospc_in_checkpoint",
        "stall_in_checkpoint",
        "skip_collective",
    ]
    step: int
    rank: int = 0
    attempt: int = 0


class ToyModel:
    class Config(_Opts):
        dim: int = Field(8, ge=1)
        seed: int = 0
        step_sleep_s: float = 0.0  # slows steps down so tests can act at a given step
        faults: list[Fault] = Field(default_factory=list)

    def __init__(self, config: Config) -> None:
        self.config = config


class ToyData:
    class Config(_Opts):
        seed: int = 1
        noise: float = 0.1

    def __init__(self, config: Config) -> None:
        self.config = config


class ToyTask:
    class Config(_Opts):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config


class ToySGD:
    class Config(_Opts):
        lr: float = 0.05
        momentum: float = 0.9

    def __init__(self, config: Config) -> None:
        self.config = config


def toy_job(name: str, run_dir: Path, *, world: int = 2, steps: int = 8, **sections: Any) -> dict[str, Any]:
    """A job dict (engine config + `cluster:`); keyword sections are merged over the defaults."""
    data: dict[str, Any] = {
        "run": {"name": name, "dir": str(run_dir)},
        "mesh": {"data_parallel_shard": world},
        "batching": {"global_batch_size": 8, "microbatch_size": 1},
        "trainer": {"total_steps": steps},
        "checkpointing": {"period": 2, "keep_last": 2},
        "timeouts": {"init_s": 60, "step_s": 30},
        "logging": {"tracker": {"kind": "null"}},
        "model": {"provider": "tests.cluster_fixtures:ToyModel"},
        "data": {"provider": "tests.cluster_fixtures:ToyData"},
        "task": {"provider": "tests.cluster_fixtures:ToyTask"},
        "optimizer": {"provider": "tests.cluster_fixtures:ToySGD"},
        "cluster": {"entrypoint": "tests.cluster_fixtures:toy_run_rank", "restart_backoff_s": 0.1},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return data


# -- the engine ------------------------------------------------------------------------------------------


def sample(index: int, dim: int, seed: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Global sample `index`: features and target of a fixed linear teacher."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    x = torch.randn(dim, generator=g)
    teacher = torch.linspace(-1.0, 1.0, dim)
    return x, (x @ teacher + noise * torch.randn((), generator=g)).reshape(())


def local_gradient(
    w: torch.Tensor, indices: list[int], micro: int, model: ToyModel.Config, data: ToyData.Config
) -> torch.Tensor:
    """[sum of squared-error gradients, sum of squared errors] over `indices`, microbatch by microbatch."""
    grad = torch.zeros(model.dim)
    loss_sum = torch.zeros(())
    for start in range(0, len(indices), micro):
        pairs = [sample(i, model.dim, data.seed, data.noise) for i in indices[start : start + micro]]
        x = torch.stack([p[0] for p in pairs])
        y = torch.stack([p[1] for p in pairs])
        err = x @ w - y
        loss_sum += (err * err).sum()
        grad += 2 * (x.T @ err)
    return torch.cat([grad, loss_sum.reshape(1)])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class _Toy:
    def __init__(self, config: dict[str, Any], runtime: RankRuntime, reporter: RunReporter) -> None:
        self.cfg = parse_config(config, check_components=False)
        self.model = ToyModel.Config.model_validate(self.cfg.model.options)
        self.data = ToyData.Config.model_validate(self.cfg.data.options)
        self.optim = ToySGD.Config.model_validate(self.cfg.optimizer.options)
        self.runtime = runtime
        self.reporter = reporter
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        dp = runtime.data_parallel_override or self.cfg.mesh.data_parallel
        if dp != self.world:
            raise ValueError(f"the toy engine is pure data parallel: dp={dp} but world size {self.world}")
        self.global_batch = self.cfg.batching.global_batch_size
        self.micro = self.cfg.batching.microbatch_size
        self.accumulation = self.cfg.batching.gradient_accumulation(dp)
        self.lr = self.optim.lr
        g = torch.Generator().manual_seed(self.model.seed)
        self.w = torch.randn(self.model.dim, generator=g) * 0.1
        self.mom = torch.zeros(self.model.dim)
        self.step = 0
        self.position = 0  # next global sample index
        self.saved = 0  # the newest step committed (or resumed from)
        self.losses: list[float] = []
        self.ckpt_root = self.cfg.checkpoint_dir
        log_dir = runtime.run_dir / "samples"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.sample_log = log_dir / f"attempt-{runtime.attempt}-rank-{self.rank}.jsonl"

    # -- checkpoints -----------------------------------------------------------------------------------

    def resume(self) -> None:
        path = self.reporter.latest_checkpoint()
        if path is None:
            return
        meta = torch.load(path / "engine.pt", weights_only=True)
        shards = sorted(path.glob("shard-*.pt"))
        if len(shards) != meta["world_size"]:
            raise RuntimeError(f"{path}: {len(shards)} shards for world size {meta['world_size']}")
        parts = [torch.load(s, weights_only=True) for s in shards]
        self.w = torch.cat([p["w"] for p in parts])
        self.mom = torch.cat([p["mom"] for p in parts])
        self.step = int(meta["step"])
        self.position = int(meta["position"])
        self.lr = float(meta["lr"])
        self.saved = self.step

    def save(self) -> None:
        step_dir = self.ckpt_root / step_dir_name(self.step)
        step_dir.mkdir(parents=True, exist_ok=True)
        name = f"shard-{self.rank:05d}.pt"
        payload = {
            "w": torch.tensor_split(self.w, self.world)[self.rank].clone(),
            "mom": torch.tensor_split(self.mom, self.world)[self.rank].clone(),
        }
        names = [name]
        if self._fault("exit_in_checkpoint", self.step):
            (step_dir / name).write_bytes(b"half a shard")
            os._exit(1)
        if self._fault("enospc_in_checkpoint", self.step):
            (step_dir / name).write_bytes(b"half a shard")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(step_dir / name))
        if self._fault("stall_in_checkpoint", self.step):
            with storage_operation("writing", str(step_dir / name)):  # a store that stops answering
                time.sleep(2.5)
        torch.save(payload, step_dir / name)
        if self.rank == 0:
            meta = {"step": self.step, "position": self.position, "world_size": self.world, "lr": self.lr}
            torch.save(meta, step_dir / "engine.pt")
            names.append("engine.pt")
        files = tuple(CheckpointFile(n, (step_dir / n).stat().st_size, _sha256(step_dir / n)) for n in names)
        report = RankCheckpointReport(self.step, self.rank, step_dir, files)
        self.reporter.checkpoint_written(report)
        reports: list[Any] = [None] * self.world if self.rank == 0 else []
        dist.gather_object(report, reports if self.rank == 0 else None, dst=0)
        if self.rank == 0:
            self.reporter.commit_checkpoint(self.step, reports)
        dist.barrier()
        self.saved = self.step

    # -- loop -------------------------------------------------------------------------------------------

    def _fault(self, kind: str, step: int) -> bool:
        return any(
            f.kind == kind and f.step == step and f.rank == self.rank and f.attempt == self.runtime.attempt
            for f in self.model.faults
        )

    def _commands(self) -> list[Command]:
        box: list[Any] = [list(self.reporter.commands(self.step)) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return list(box[0])

    def apply_commands(self) -> bool:
        """False when training must stop. Paused: keep polling until resume/stop."""
        paused = announced = False
        while True:
            checkpoint = False
            for command in self._commands():
                if command.kind is CommandKind.STOP:
                    return False
                if command.kind is CommandKind.PAUSE:
                    paused = True
                elif command.kind is CommandKind.RESUME:
                    paused = False
                elif command.kind is CommandKind.CHECKPOINT_NOW:
                    checkpoint = True
                elif command.kind is CommandKind.UPDATE and "lr" in command.values:
                    self.lr = float(command.values["lr"])
            if checkpoint and self.step > 0:
                self.save()
            if not paused:
                return True
            if not announced and self.rank == 0:  # the RunReporter contract: say where the ranks stopped
                self.reporter.metrics(MetricPoint(self.step, 0, {"paused": 1.0}, "health", time.time()))
            announced = True
            time.sleep(0.05)

    def train_step(self) -> float:
        per_rank = self.global_batch // self.world
        first = self.position + self.rank * per_rank
        indices = list(range(first, first + per_rank))
        packed = local_gradient(self.w, indices, self.micro, self.model, self.data)
        if self._fault("hang", self.step + 1):
            time.sleep(3600)
        if self._fault("raise", self.step + 1):
            raise RuntimeError(f"injected failure at step {self.step + 1}")
        if self._fault("raise_non_retryable", self.step + 1):
            from d9d.cluster import NonRetryableError

            raise NonRetryableError(f"injected fatal error at step {self.step + 1}")
        if not self._fault("skip_collective", self.step + 1):  # a rank that skips it goes on to the next one
            dist.all_reduce(packed)
        loss = self.update(packed)
        self.position += self.global_batch
        self.step += 1
        with self.sample_log.open("a") as f:
            f.write(json.dumps({"step": self.step, "indices": indices}) + "\n")
        return loss

    def update(self, summed: torch.Tensor) -> float:
        """SGD with momentum on the all-reduced [gradient sum, loss sum]; returns the step's mean loss."""
        self.mom = self.optim.momentum * self.mom + summed[:-1] / self.global_batch
        self.w = self.w - self.lr * self.mom
        return float(summed[-1]) / self.global_batch

    def run(self) -> RankResult:
        self.resume()
        total = self.cfg.trainer.total_steps
        period = self.cfg.checkpointing.period
        status: Literal["finished", "stopped"] = "finished"
        samples_per_s = None
        while self.step < total:
            if not self.apply_commands():
                status = "stopped"
                if self.step > self.saved:  # as the engine does: a stopped run commits the step it stopped at
                    self.save()
                break
            if self.model.step_sleep_s:  # inside the step: commands sent meanwhile wait for its end
                time.sleep(self.model.step_sleep_s)
            start = time.perf_counter()
            loss = self.train_step()
            elapsed = time.perf_counter() - start
            samples_per_s = self.global_batch / elapsed
            self.losses.append(loss)
            now = time.time()
            if self.rank == 0:
                values = {"loss": loss, "lr": self.lr, "tokens_per_s": samples_per_s}
                self.reporter.metrics(MetricPoint(self.step, 0, values, "train", now))
            health = {"step_time_s": elapsed, "rss_bytes": float(psutil.Process().memory_info().rss)}
            self.reporter.metrics(MetricPoint(self.step, self.rank, health, "health", now))
            if period is not None and self.step % period == 0:
                self.save()
        return RankResult(
            status=status,
            steps=self.step,
            final_loss=self.losses[-1] if self.losses else None,
            tokens_per_s=samples_per_s,
            losses=tuple(self.losses),
        )


def toy_run_rank(config: dict[str, Any], runtime: RankRuntime, reporter: RunReporter) -> RankResult:
    return _Toy(config, runtime, reporter).run()


# -- the failure-free reference ----------------------------------------------------------------------------


def reference_losses(job: dict[str, Any], world: int) -> list[float]:
    """Per-step losses of a failure-free run on `world` data-parallel ranks, simulated in this process.

    Each simulated rank computes its slice exactly as a real rank does; their sums are added in rank
    order in float32. For one or two ranks that is bit for bit what a gloo all-reduce gives (a single
    commutative addition per element), so a real run must match exactly; for more ranks the summation
    order differs and a comparison needs a tolerance.
    """
    cfg = parse_config({k: v for k, v in job.items() if k != "cluster"}, check_components=False)
    model = ToyModel.Config.model_validate(cfg.model.options)
    data = ToyData.Config.model_validate(cfg.data.options)
    optim = ToySGD.Config.model_validate(cfg.optimizer.options)
    batch, micro = cfg.batching.global_batch_size, cfg.batching.microbatch_size
    per_rank = batch // world
    w = torch.randn(model.dim, generator=torch.Generator().manual_seed(model.seed)) * 0.1
    mom = torch.zeros(model.dim)
    losses = []
    for step in range(cfg.trainer.total_steps):
        parts = [
            local_gradient(
                w,
                list(range(step * batch + r * per_rank, step * batch + (r + 1) * per_rank)),
                micro,
                model,
                data,
            )
            for r in range(world)
        ]
        summed = parts[0]
        for part in parts[1:]:
            summed = summed + part
        mom = optim.momentum * mom + summed[:-1] / batch
        w = w - optim.lr * mom
        losses.append(float(summed[-1]) / batch)
    return losses


def trained_samples(run_dir: Path) -> dict[int, list[int]]:
    """Step -> the sample indices of the attempt that last trained that step (the run's real history)."""
    by_step: dict[int, tuple[int, list[int]]] = {}
    for path in sorted((run_dir / "samples").glob("attempt-*-rank-*.jsonl")):
        attempt = int(path.name.split("-")[1])
        per_step: dict[int, list[int]] = {}
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            per_step.setdefault(entry["step"], []).extend(entry["indices"])
        for step, indices in per_step.items():
            if step not in by_step or by_step[step][0] < attempt:
                by_step[step] = (attempt, list(indices))
            elif by_step[step][0] == attempt:
                by_step[step][1].extend(indices)
    return {step: sorted(indices) for step, (_, indices) in sorted(by_step.items())}


def bare_engine_rank(env: RankEnv, raw: dict[str, Any]) -> None:
    """The engine's own bare-process path (no Ray), uninterrupted: the reference losses for a run on Ray,
    saved by rank 0 to `<run dir>/losses.pt`."""
    from d9d.engine.launch import run_rank  # here: the toy ranks that import this module never need it

    config = parse_config(raw)
    runtime = RankRuntime(
        rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
    )
    result = run_rank(config, runtime, LocalRunReporter(config.checkpoint_dir, 2))
    if env.rank == 0:
        config.run_dir.mkdir(parents=True, exist_ok=True)
        torch.save(list(result.losses), config.run_dir / "losses.pt")


def wait_for_step(job: TrainingJob, step: int, timeout: float = 120.0) -> None:
    """Until an attempt of the run reports a train point at `step` or later. Reads the points as the
    coordinator received them: after a restart `metrics()` leaves out the steps the new attempt trains
    again, so a wait for the restarted attempt's progress there could miss it (and did, when the first
    attempt had reached the last step before the fault)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        points, ended = job.poll_metrics(1.0, as_received=True)
        if any(p.kind == "train" and p.step >= step for p in points):
            return
        if ended and not points:
            break
    raise AssertionError(f"run {job.run_name} never reached step {step}")
