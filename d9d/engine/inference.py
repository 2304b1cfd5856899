"""Forward-only runs over a dataset with the same providers, mesh and stages as training.

The data provider yields microbatches until it returns none; the inference task consumes each
microbatch's outputs (`process_outputs`) and reports a globally reduced `result`. Progress (data position
and task state) is saved every `save_period` steps under the run directory, so an interrupted evaluation
resumes where it stopped instead of starting over.

With `pipeline_parallel > 1` each step's microbatches flow through d9d.pipeline's forward-only schedule
(`pipelining`, default `inference`); the task sees the outputs on the ranks holding the last stage, and
the others contribute nothing to its result. With context parallelism every microbatch is split over the
cp ranks first, as in training.

Uneven data (data-parallel shards of different lengths, or a short last step) runs in lockstep: a forward
under FSDP, expert, tensor or context parallelism is itself a sequence of collectives, so every rank must
run the same number of forwards. Each step all ranks agree (one small all-reduce) on the largest
microbatch count any rank holds; a rank with fewer makes up the difference with placeholders (a copy of
its last microbatch, or another rank's when it never had one) whose outputs are discarded: they never
reach the task, its result or the saved progress.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

import torch
import torch.distributed as dist
from pydantic import Field, model_validator
from torch import nn

from d9d.core.context import DistributedContext
from d9d.core.dist_ops import all_gather_object, gather_object
from d9d.core.domains import MeshDomain
from d9d.core.files import atomic_write_bytes, atomic_write_text
from d9d.core.mesh_params import DeviceMeshParameters
from d9d.core.pytree import tree_to
from d9d.determinism import RankSeeds, seed_everything
from d9d.engine.checkpoint_io import CheckpointError, load_state_file
from d9d.engine.components import (
    DataComponent,
    InferenceTaskComponent,
    PerplexityTaskComponent,
    build_data,
    build_inference_task,
)
from d9d.engine.config import DeterminismConfig, RunConfig, TimeoutsConfig, _Section
from d9d.engine.parallel_checks import check_model_layout
from d9d.engine.providers import DataSetup
from d9d.engine.registry import ModelComponent, build_model
from d9d.engine.stages import build_stages
from d9d.parallel.compile import CompileConfig
from d9d.parallel.context import ContextParallelGroup, shard_microbatch
from d9d.pipeline.api import PipelineStageInfo
from d9d.pipeline.runtime.executor import PipelineExecutor
from d9d.pipeline.schedule.config import InferenceSchedule, build_schedule
from d9d.pipeline.setup import PipelineSetup

#: The progress manifest: the current state file's name, size and sha256 (the state file is named by its
#: hash, so replacing the manifest is the whole commit and a crash leaves the previous pair intact).
STATE_FILE = "inference_state.json"
_STATE_PREFIX = "inference_state"


class InferenceConfig(_Section):
    run: RunConfig
    mesh: DeviceMeshParameters = Field(default_factory=DeviceMeshParameters)
    microbatch_size: int = Field(ge=1)
    model: ModelComponent
    data: DataComponent
    task: InferenceTaskComponent = Field(default_factory=PerplexityTaskComponent)
    # Regional torch.compile of the stage, as in training (d9d.parallel.compile).
    compile: CompileConfig = Field(default_factory=CompileConfig)
    determinism: DeterminismConfig = Field(default_factory=DeterminismConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    # Save progress every N microbatch steps (None: never; an interrupted run starts over).
    save_period: int | None = Field(None, ge=1)
    # The forward-only schedule when mesh.pipeline_parallel > 1 (None: `inference`, one stage per rank) ...
    pipelining: InferenceSchedule | None = None
    # ... and how many microbatches each step sends through it (None: pipeline_parallel, which keeps every
    # stage busy once the pipeline is full). A step that gets fewer (the end of the data) runs those.
    microbatches_per_step: int | None = Field(None, ge=1)

    @property
    def schedule(self) -> InferenceSchedule:
        return self.pipelining if self.pipelining is not None else InferenceSchedule()

    @property
    def num_microbatches(self) -> int:
        if self.microbatches_per_step is not None:
            return self.microbatches_per_step
        return self.mesh.pipeline_parallel

    @model_validator(mode="after")
    def _check_parallelism(self) -> Self:
        if self.mesh.pipeline_parallel > 1:
            try:
                build_schedule(self.schedule, self.mesh.pipeline_parallel, self.num_microbatches)
            except ValueError as e:
                raise ValueError(
                    f"pipelining ({self.schedule.kind}, mesh.pipeline_parallel="
                    f"{self.mesh.pipeline_parallel}, microbatches_per_step={self.num_microbatches}): {e}"
                ) from e
        check_model_layout(self.mesh, self.model, self.data, self.task, self.schedule.stages_per_rank)
        if self.compile.mode == "reduce-overhead":
            raise ValueError(
                "compile.mode: reduce-overhead is a training setting (CUDA graphs replayed step after step); "
                "inference is not measured under it: use compile.mode: default"
            )
        return self


class Inference:
    def __init__(self, config: InferenceConfig, ctx: DistributedContext) -> None:
        self.config = config
        self.ctx = ctx
        self.state_path = config.run.resolved_dir / STATE_FILE
        self.state_dir = config.run.resolved_dir
        seeds = RankSeeds.for_rank(ctx.params, ctx.rank, config.determinism.seed)
        self.task = build_inference_task(config.task)
        self.data = build_data(config.data)
        self.seeds = seeds
        self.module: nn.Module | None = None
        self.pipeline: PipelineSetup | None = None
        self.stages: dict[int, nn.Module] = {}
        self._executors: dict[int, PipelineExecutor] = {}
        self.cp = ContextParallelGroup.from_context(ctx) if ctx.params.context_parallel > 1 else None
        # Tensor-parallel ranks compute the same outputs: only tp coordinate 0 gives them to the task, so a
        # result reduced over the world counts every token once.
        self.reports_outputs = not ctx.is_distributed or ctx.coordinates(MeshDomain.REGULAR)["tp"] == 0
        self.steps = 0
        # The microbatch (as the provider gave it) that placeholders copy once this rank's data runs out.
        self._placeholder: Any | None = None

    def setup(self) -> None:
        c, ctx = self.config, self.ctx
        dp_size = ctx.params.data_parallel
        microbatches = c.num_microbatches if ctx.params.pipeline_parallel > 1 else 1
        self.data.setup(
            DataSetup(
                dp_rank=ctx.coordinates(MeshDomain.BATCH)["dp"],
                dp_size=dp_size,
                microbatch_size=c.microbatch_size,
                gradient_accumulation=microbatches,
                global_batch_size=c.microbatch_size * dp_size * microbatches,
                seed=c.determinism.seed,
            )
        )
        infos = [PipelineStageInfo()]
        if ctx.params.pipeline_parallel > 1:
            # Collective (P2P groups): every rank builds it at this point, as training does.
            self.pipeline = PipelineSetup.create(ctx, c.schedule, microbatches)
            infos = self.pipeline.local_stages
        stages = build_stages(
            build_model(c.model),
            infos,
            ctx,
            parameter_seed=self.seeds.parameters,
            compile_config=c.compile,
            training=False,
        )
        seed_everything(self.seeds.activations)
        self.module = stages.modules[0]
        self.stages = stages.by_index
        state = self._load_state()
        if state is not None:
            self.steps = int(state["steps"])
            self.data.load_state_dict(state["data"][self._state_rank(state)])
            self.task.load_state_dict(state["task"][self._state_rank(state)])
            ctx.logger.info("resuming inference after %d steps", self.steps)

    def _state_rank(self, state: dict[str, Any]) -> int:
        if len(state["data"]) != self.ctx.world_size:
            raise RuntimeError(
                f"{self.state_path} was saved by {len(state['data'])} ranks; "
                f"resume it on the same number of ranks, not {self.ctx.world_size}"
            )
        return self.ctx.rank

    @torch.no_grad()
    def run(self) -> dict[str, float]:
        module = self.module
        if module is None:
            raise RuntimeError("Inference.setup() must run first")
        while True:
            microbatches = list(self.data.next_step())
            real = len(microbatches)
            if microbatches:
                self._placeholder = microbatches[-1]
            count = self._step_count(real)
            if count == 0:
                break
            # Placeholders keep this rank in the other ranks' collectives; only the first `real` count.
            microbatches += [self._placeholder] * (count - real)
            local = [self._prepare(mb) for mb in microbatches]
            if self.pipeline is not None:
                self._pipelined(local, real)
            else:
                for index, microbatch in enumerate(local):
                    outputs = module(**self.task.forward_inputs(microbatch))
                    if index < real and self.reports_outputs:
                        self.task.process_outputs(outputs, microbatch)
            self.steps += 1
            period = self.config.save_period
            if period is not None and self.steps % period == 0:
                self._save()
        result = self.task.result(self.ctx)
        if self.ctx.is_main_process:
            self._remove_states(keep=None)  # finished: a later run evaluates anew
        return result

    def _prepare(self, microbatch: Any) -> Any:
        microbatch = tree_to(microbatch, self.ctx.device, non_blocking=True)
        if self.cp is None:
            return microbatch
        if not isinstance(microbatch, Mapping):
            raise TypeError(
                f"context parallelism splits mapping microbatches, got {type(microbatch).__name__}"
            )
        return shard_microbatch(microbatch, self.cp)

    def _pipelined(self, microbatches: list[Any], real: int) -> None:
        """One forward-only pipeline step over `microbatches`, of which the first `real` are data (the rest
        placeholders). Every rank runs the same count (`_step_count`): fewer than configured at the end of
        the data, a program for those."""
        setup = self.pipeline
        assert setup is not None
        count = len(microbatches)
        executor = self._executors.get(count)
        if executor is None:
            # The same stage-to-stage channels serve any microbatch count: only the program differs.
            executor = PipelineExecutor(
                build_schedule(self.config.schedule, self.ctx.params.pipeline_parallel, count),
                self.stages,
                pp_rank=setup.pp_rank,
                device=self.ctx.device,
                channels=setup.channels,
                pp_group=setup.pp_group,
            )
            self._executors[count] = executor

        def consume(outputs: Any, microbatch: int) -> None:
            if microbatch < real and self.reports_outputs:
                self.task.process_outputs(outputs, microbatches[microbatch])

        executor.forward_step([self.task.forward_inputs(mb) for mb in microbatches], consume)

    def _step_count(self, count: int) -> int:
        """The number of microbatches every rank runs this step: the largest any rank holds (0: all ranks
        are done). Ranks may run out of data at different steps (uneven shards), but a rank that stopped
        early would leave the others waiting in the collectives of their next forward (FSDP's all-gathers,
        expert exchanges, ...), so a rank with fewer fills up with placeholders. One all-reduce of
        [count, lacks a placeholder, -(lowest rank that has one)]; a rank that never had data (and after a
        resume, none has a placeholder yet) takes the lowest such rank's microbatch (one object exchange,
        at most once per rank).
        """
        if not self.ctx.is_distributed:
            return count
        world, has = self.ctx.world_size, self._placeholder is not None
        t = torch.tensor([float(count), 0.0 if has else 1.0, -float(self.ctx.rank if has else world)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        most, lacking, source = int(t[0].item()), bool(t[1].item()), -int(t[2].item())
        if most > 0 and lacking:
            # Every rank takes part; only the source sends a microbatch (the others send None).
            sent = all_gather_object(self._placeholder if self.ctx.rank == source else None)
            if not has:
                self._placeholder = sent[source]
        return most

    def _save(self) -> None:
        data = gather_object(self.data.state_dict()) if self.ctx.is_distributed else [self.data.state_dict()]
        task = gather_object(self.task.state_dict()) if self.ctx.is_distributed else [self.task.state_dict()]
        if self.ctx.is_main_process:
            assert data is not None and task is not None
            self.state_dir.mkdir(parents=True, exist_ok=True)
            buffer = io.BytesIO()
            torch.save({"steps": self.steps, "data": data, "task": task}, buffer)
            payload = buffer.getvalue()
            digest = hashlib.sha256(payload).hexdigest()
            name = f"{_STATE_PREFIX}-{digest[:16]}.pt"
            atomic_write_bytes(self.state_dir / name, payload)
            manifest = {"file": name, "size": len(payload), "sha256": digest}
            atomic_write_text(self.state_path, json.dumps(manifest) + "\n")
            self._remove_states(keep=name)

    def _remove_states(self, keep: str | None) -> None:
        """Drop state files other than `keep` (and the manifest too when `keep` is None)."""
        if keep is None:
            self.state_path.unlink(missing_ok=True)
        for path in self.state_dir.glob(f"{_STATE_PREFIX}*.pt"):
            if path.name != keep:
                path.unlink(missing_ok=True)

    def _load_state(self) -> dict[str, Any] | None:
        """The saved progress, verified against its manifest (size, sha256) before it is loaded
        weights-only; None when there is none."""
        if not self.state_path.is_file():
            stray = sorted(p.name for p in self.state_dir.glob(f"{_STATE_PREFIX}*.pt"))
            if stray:
                raise CheckpointError(
                    f"{self.state_dir} holds inference progress ({', '.join(stray)}) without its manifest "
                    f"{STATE_FILE}; nothing vouches for it: delete it to start over"
                )
            return None
        try:
            manifest = json.loads(self.state_path.read_text())
            name, size, digest = str(manifest["file"]), int(manifest["size"]), str(manifest["sha256"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.state_path} is not a readable progress manifest: {e}") from None
        path = self.state_dir / name
        if Path(name).name != name or not name.startswith(_STATE_PREFIX) or not path.is_file():
            raise CheckpointError(f"{self.state_path} names {name!r}, which is not a progress file here")
        data = path.read_bytes()
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointError(f"{path} does not match the size and sha256 in {self.state_path}")
        state = load_state_file(path)
        if not isinstance(state, dict):
            raise CheckpointError(f"{path} holds a {type(state).__name__}, not inference progress")
        return state


def run_inference(config: InferenceConfig, ctx: DistributedContext) -> dict[str, float]:
    runner = Inference(config, ctx)
    runner.setup()
    return runner.run()
