"""Forward-only runs over a dataset with the same providers, mesh and stages as training.

The data provider yields microbatches until it returns none; the inference task consumes each
microbatch's outputs (`process_outputs`) and reports a globally reduced `result`. Progress (data position
and task state) is saved every `save_period` steps under the run directory, so an interrupted evaluation
resumes where it stopped instead of starting over.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from pydantic import Field

from d9d.core.context import DistributedContext
from d9d.core.domains import MeshDomain
from d9d.core.mesh_params import DeviceMeshParameters
from d9d.core.pytree import tree_to
from d9d.determinism import RankSeeds, parameter_init_rng, seed_everything
from d9d.engine.config import ComponentConfig, DeterminismConfig, RunConfig, TimeoutsConfig, _Section
from d9d.engine.providers import DataProvider, DataSetup, InferenceTask, ModelProvider
from d9d.engine.registry import build_component
from d9d.pipeline.api import PipelineStageInfo

STATE_FILE = "inference_state.pt"


class InferenceConfig(_Section):
    run: RunConfig
    mesh: DeviceMeshParameters = Field(default_factory=DeviceMeshParameters)
    microbatch_size: int = Field(ge=1)
    model: ComponentConfig
    data: ComponentConfig
    task: ComponentConfig = Field(default_factory=lambda: ComponentConfig(provider="perplexity"))
    determinism: DeterminismConfig = Field(default_factory=DeterminismConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    # Save progress every N microbatch steps (None: never; an interrupted run starts over).
    save_period: int | None = Field(None, ge=1)


class Inference:
    def __init__(self, config: InferenceConfig, ctx: DistributedContext) -> None:
        if ctx.params.pipeline_parallel != 1:
            raise NotImplementedError("pipelined inference runs through d9d.pipeline's inference schedule")
        self.config = config
        self.ctx = ctx
        self.state_path = config.run.resolved_dir / STATE_FILE

    def setup(self) -> None:
        c, ctx = self.config, self.ctx
        seeds = RankSeeds.for_rank(ctx.params, ctx.rank, c.determinism.seed)
        self.task: InferenceTask = build_component("inference_task", c.task, "task")
        self.data: DataProvider = build_component("data", c.data, "data")
        dp_size = ctx.params.data_parallel
        self.data.setup(
            DataSetup(
                dp_rank=ctx.coordinates(MeshDomain.BATCH)["dp"],
                dp_size=dp_size,
                microbatch_size=c.microbatch_size,
                gradient_accumulation=1,
                global_batch_size=c.microbatch_size * dp_size,
                seed=c.determinism.seed,
            )
        )
        provider: ModelProvider = build_component("model", c.model, "model")
        with torch.device("meta"):
            module = provider.build_stage(PipelineStageInfo())
        provider.parallelize(module, ctx)
        module.to_empty(device=ctx.device)
        mesh = (
            ctx.mesh_for(MeshDomain.REGULAR)["dp_replicate", "dp_shard", "cp", "tp"]
            if ctx.is_distributed
            else None
        )
        with torch.no_grad(), parameter_init_rng(seeds.parameters, mesh):
            provider.initialize(module, ctx)
        seed_everything(seeds.activations)
        self.module = module.eval()
        self.steps = 0
        if self.state_path.is_file():
            state: dict[str, Any] = torch.load(self.state_path, weights_only=True)
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
        while True:
            microbatches = self.data.next_step()
            if not self._any_rank_has(bool(microbatches)):
                break
            for microbatch in microbatches:
                microbatch = tree_to(microbatch, self.ctx.device, non_blocking=True)
                outputs = self.module(**self.task.forward_inputs(microbatch))
                self.task.process_outputs(outputs, microbatch)
            self.steps += 1
            period = self.config.save_period
            if period is not None and self.steps % period == 0:
                self._save()
        result = self.task.result(self.ctx)
        if self.ctx.is_main_process and self.state_path.exists():
            self.state_path.unlink()  # finished: a later run evaluates anew
        return result

    def _any_rank_has(self, flag: bool) -> bool:
        """Ranks may run out of data at different steps (uneven shards); stop when all have."""
        if not self.ctx.is_distributed:
            return flag
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def _save(self) -> None:
        from d9d.core.dist_ops import gather_object

        data = gather_object(self.data.state_dict()) if self.ctx.is_distributed else [self.data.state_dict()]
        task = gather_object(self.task.state_dict()) if self.ctx.is_distributed else [self.task.state_dict()]
        if self.ctx.is_main_process:
            assert data is not None and task is not None
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(f".tmp-{os.getpid()}")
            torch.save({"steps": self.steps, "data": data, "task": task}, tmp)
            os.replace(tmp, self.state_path)


def run_inference(config: InferenceConfig, ctx: DistributedContext) -> dict[str, float]:
    runner = Inference(config, ctx)
    runner.setup()
    return runner.run()
