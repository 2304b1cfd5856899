"""Built-in optimizer providers.

Every one puts a stage's trainable parameters in one param group, or with `no_weight_decay` /
`no_weight_decay_1d` in two: decayed, and exempt (`weight_decay` 0), in the parameters' order; a group with
no parameter on a stage is left out (docs/optim.md, "Weight-decay exemptions").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from d9d.engine.providers import ModelProvider
from d9d.optim import PiecewiseScheduleConfig, StochasticAdamW, build_piecewise_lr
from d9d.optim.param_groups import DecayExemptions, keep_weight_decay_on_load, parameter_name
from d9d.pipeline.api import PipelineStageInfo

NO_WEIGHT_DECAY_KEY = "optimizer.options.no_weight_decay"


def _unset(value: object) -> bool:
    """Left out of the dumped config at its default, so a run without exemptions keeps the run identity
    (`d9d.engine.identity`) it had before the option existed: its checkpoints still resume."""
    return not value


class _Options(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Trained without weight decay (a second param group, weight_decay 0): each parameter whose whole name,
    # as the model's state dict and checkpoints name it (`model.layers.3.input_layernorm.weight`), matches
    # one of these regular expressions (`re.fullmatch`). A pattern that matches no parameter of the whole
    # model (all pipeline stages, frozen parameters included) is refused when the job starts.
    no_weight_decay: tuple[str, ...] = Field((), exclude_if=_unset)
    # Also every parameter of at most one dimension: norm weights and biases.
    no_weight_decay_1d: bool = Field(False, exclude_if=_unset)

    @field_validator("no_weight_decay")
    @classmethod
    def _check_patterns(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        try:
            DecayExemptions(patterns)  # compiles each pattern
        except ValueError as e:
            raise ValueError(f"no_weight_decay{e}") from None
        return patterns

    @property
    def exemptions(self) -> DecayExemptions:
        return DecayExemptions(self.no_weight_decay, self.no_weight_decay_1d)


class _AdamOptions(_Options):
    """The hyperparameters every Adam-style optimizer here shares."""

    lr: float = Field(3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)


def _params(
    options: _Options, named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float
) -> list[nn.Parameter] | list[dict[str, Any]]:
    """What the torch optimizer takes: without exemptions the trainable parameters (one group, as always),
    else the decayed and the exempt group."""
    exemptions = options.exemptions
    if exemptions.enabled:
        return exemptions.param_groups(named_parameters, weight_decay)
    return [p for _, p in named_parameters if p.requires_grad]


def _finish(options: _Options, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    if options.exemptions.enabled:
        # The config's decay wins over a loaded state's (e.g. one saved before the exemptions existed).
        keep_weight_decay_on_load(optimizer)
    return optimizer


def model_parameter_names(model: ModelProvider, num_stages: int) -> set[str]:
    """Every parameter name of the whole model split into `num_stages` pipeline stages (each stage built on
    the meta device: nothing allocated), as the state dict names them."""
    names: set[str] = set()
    for index in range(num_stages):
        with torch.device("meta"):
            stage = model.build_stage(PipelineStageInfo(index, num_stages))
        names.update(parameter_name(name) for name, _ in stage.named_parameters())
    return names


def _check_model(options: _Options, model: ModelProvider, num_stages: int) -> None:
    """Each `no_weight_decay` pattern must match a parameter of the whole model: a stage holds only its
    own parameters, so every stage is built on meta. Deterministic: every rank raises the same error,
    before any collective (the engine calls it through `OptimizerModelCheck`)."""
    if options.no_weight_decay:
        options.exemptions.check_matches(model_parameter_names(model, num_stages), NO_WEIGHT_DECAY_KEY)


class AdamWProvider:
    class Config(_AdamOptions):
        # Fused kernels where the device supports them (CUDA); the foreach path elsewhere.
        fused: bool | None = None

    def __init__(self, config: Config) -> None:
        self.config = config

    def check_model(self, model: ModelProvider, num_stages: int) -> None:
        _check_model(self.config, model, num_stages)

    def build(
        self, named_parameters: Iterable[tuple[str, nn.Parameter]], *, seed: int
    ) -> torch.optim.Optimizer:
        c = self.config
        named = list(named_parameters)
        trainable = [p for _, p in named if p.requires_grad]
        fused = c.fused if c.fused is not None else bool(trainable) and trainable[0].device.type == "cuda"
        optimizer = torch.optim.AdamW(
            _params(c, named, c.weight_decay),
            lr=c.lr,
            betas=c.betas,
            eps=c.eps,
            weight_decay=c.weight_decay,
            fused=fused or None,
        )
        return _finish(c, optimizer)


class SGDProvider:
    class Config(_Options):
        lr: float = Field(1e-2, gt=0)
        momentum: float = Field(0.0, ge=0)
        weight_decay: float = Field(0.0, ge=0)
        nesterov: bool = False

    def __init__(self, config: Config) -> None:
        self.config = config

    def check_model(self, model: ModelProvider, num_stages: int) -> None:
        _check_model(self.config, model, num_stages)

    def build(
        self, named_parameters: Iterable[tuple[str, nn.Parameter]], *, seed: int
    ) -> torch.optim.Optimizer:
        c = self.config
        optimizer = torch.optim.SGD(
            _params(c, named_parameters, c.weight_decay),
            lr=c.lr,
            momentum=c.momentum,
            weight_decay=c.weight_decay,
            nesterov=c.nesterov,
        )
        return _finish(c, optimizer)


class StochasticAdamWProvider:
    """bf16 parameters updated in fp32 and written back with stochastic rounding (d9d.optim)."""

    class Config(_AdamOptions):
        state_dtype: Literal["float32", "bfloat16"] = "float32"
        backend: Literal["auto", "triton", "torch"] = "auto"

    def __init__(self, config: Config) -> None:
        self.config = config

    def check_model(self, model: ModelProvider, num_stages: int) -> None:
        _check_model(self.config, model, num_stages)

    def build(
        self, named_parameters: Iterable[tuple[str, nn.Parameter]], *, seed: int
    ) -> torch.optim.Optimizer:
        c = self.config
        optimizer = StochasticAdamW(
            _params(c, named_parameters, c.weight_decay),
            lr=c.lr,
            betas=c.betas,
            eps=c.eps,
            weight_decay=c.weight_decay,
            state_dtype=getattr(torch, c.state_dtype),
            seed=seed % 2**63,
            backend=c.backend,
        )
        return _finish(c, optimizer)


class PiecewiseLRProvider:
    """Warmup/decay phases as LR multipliers (d9d.optim.lr); see docs/lr_scheduler.md."""

    class Config(PiecewiseScheduleConfig):
        pass

    def __init__(self, config: Config) -> None:
        self.config = config

    def build(
        self, optimizer: torch.optim.Optimizer, total_steps: int
    ) -> torch.optim.lr_scheduler.LRScheduler:
        return build_piecewise_lr(self.config, optimizer, total_steps)

    def check_run(self, total_steps: int) -> None:
        self.config.resolve(total_steps)
