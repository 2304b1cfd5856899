"""One optimizer and one LR scheduler per local stage, stepped together.

A rank holds one stage without pipelining and several under interleaved and V schedules. Each stage keeps
its own optimizer (built over its own parameters) and scheduler, so its state travels with the stage: a
checkpoint written under one placement can be loaded under another that puts the stage elsewhere. These
containers make the set behave as a single optimizer and scheduler for the training loop; their state dicts
are keyed by stage index. Pairing stages with optimizers, or optimizers with schedulers, checks that both
sides hold the same stages (a missing or extra one is an error, never silently dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from d9d.core.dtensor import local_tensor

Optimizer = torch.optim.Optimizer
LRScheduler = torch.optim.lr_scheduler.LRScheduler


def _check_stages(kind: str, have: Iterable[int], got: Iterable[str]) -> None:
    mine, theirs = sorted(str(s) for s in have), sorted(got)
    if mine != theirs:
        raise ValueError(f"{kind} state is for stages {theirs}, but this rank holds stages {mine}")


def _check_same_stages(what: str, mine: Iterable[int], theirs: Iterable[int]) -> None:
    a, b = sorted(mine), sorted(theirs)
    if a != b:
        raise ValueError(f"{what}: stages {b} do not match the optimizer's stages {a}")


class PipelinedOptimizer:
    def __init__(self, optimizers: Mapping[int, Optimizer]) -> None:
        if not optimizers:
            raise ValueError("PipelinedOptimizer needs at least one stage optimizer")
        self.optimizers = dict(sorted(optimizers.items()))

    @classmethod
    def build(
        cls, stages: Mapping[int, nn.Module], factory: Callable[[Iterable[nn.Parameter]], Optimizer]
    ) -> PipelinedOptimizer:
        """`factory` builds one optimizer over one stage's trainable parameters."""
        return cls({s: factory([p for p in m.parameters() if p.requires_grad]) for s, m in stages.items()})

    @property
    def stages(self) -> list[int]:
        return list(self.optimizers)

    def pair_with(self, modules: Mapping[int, nn.Module]) -> list[tuple[nn.Module, Optimizer]]:
        """(module, its optimizer) per stage, in stage order; the stages must be exactly this rank's."""
        _check_same_stages("modules", self.optimizers, modules)
        return [(modules[s], opt) for s, opt in self.optimizers.items()]

    @property
    def lr(self) -> float:
        """The first stage's first group's learning rate (all stages follow one schedule)."""
        return float(next(iter(self.optimizers.values())).param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every stage's groups, in stage order (the dicts themselves: setting `lr` here sets it there)."""
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    def step(self, skip_if: torch.Tensor | None = None, grad_divisor: torch.Tensor | None = None) -> None:
        """One update of every stage. `skip_if` (a float32 scalar on the device, 1.0 or 0.0; only where
        `skips_on_device` is true) makes the update a no-op on the device when it is 1.0, without the host
        reading it first: the fused Adam kernels' `found_inf` input, which returns before touching parameters
        or moments and takes back the step count it added. `grad_divisor` (a scalar on the device; only where
        `divides_gradients` is true): the gradients are that many times the ones to apply; the fused kernels'
        `grad_scale` input divides each in float32 as it is read and writes the quotient back to `.grad`.
        Both inputs are torch's GradScaler API of fused Adam."""
        if skip_if is not None and not self.skips_on_device:
            raise RuntimeError("step(skip_if=...) needs fused Adam/AdamW stages with state (skips_on_device)")
        if grad_divisor is not None and not self.divides_gradients:
            raise RuntimeError("step(grad_divisor=...) needs fused Adam/AdamW stages (divides_gradients)")
        # float32, as GradScaler's scale: the kernels read it as such
        scale = None if grad_divisor is None else grad_divisor.to(torch.float32)
        for opt in self.optimizers.values():
            if _fused_adam_with_state(opt) and _sharded_alike(opt):
                _fused_adam_step_on_shards(opt, grad_scale=scale, found_inf=skip_if)
                continue
            if skip_if is not None:
                opt.found_inf = skip_if  # type: ignore[attr-defined]  # read by Adam.step
            if scale is not None:
                opt.grad_scale = scale  # type: ignore[attr-defined]  # read by Adam.step
            try:
                opt.step()
            finally:
                opt.__dict__.pop("found_inf", None)
                opt.__dict__.pop("grad_scale", None)

    @property
    def divides_gradients(self) -> bool:
        """Whether `step(grad_divisor=...)` can divide the gradients inside the update: every stage is a
        fused torch Adam/AdamW. The engine then leaves the division by the loss weight (and clipping's
        factor) to it: a separate pass over every gradient costs a kernel per tensor (`_foreach_mul_` with a
        float32 scale beside bf16 gradients): 3.9 ms of a 153 ms dense step, 8.8 ms of a 150 ms MoE step on
        one H200."""
        return all(_fused_adam(opt) for opt in self.optimizers.values())

    @property
    def skips_on_device(self) -> bool:
        """Whether `step(skip_if=...)` can skip on the device: every stage is a fused torch Adam/AdamW whose
        state already exists for every parameter. The first step creates that state (a skip there would
        create it too, which a host-side skip does not), so it, and any other optimizer, decide on the
        host."""
        return all(_fused_adam_with_state(opt) for opt in self.optimizers.values())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {str(s): opt.state_dict() for s, opt in self.optimizers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_stages("optimizer", self.optimizers, state)
        for s, opt in self.optimizers.items():
            opt.load_state_dict(state[str(s)])


class PipelinedLRScheduler:
    def __init__(
        self, schedulers: Mapping[int, LRScheduler], optimizer: PipelinedOptimizer | None = None
    ) -> None:
        """With `optimizer`, each stage's scheduler must drive that stage's optimizer."""
        if not schedulers:
            raise ValueError("PipelinedLRScheduler needs at least one stage scheduler")
        self.schedulers = dict(sorted(schedulers.items()))
        if optimizer is not None:
            _check_same_stages("LR schedulers", optimizer.optimizers, self.schedulers)
            for s, scheduler in self.schedulers.items():
                if scheduler.optimizer is not optimizer.optimizers[s]:
                    raise ValueError(
                        f"the LR scheduler of stage {s} drives another optimizer than the stage's"
                    )

    @classmethod
    def build(
        cls, optimizer: PipelinedOptimizer, factory: Callable[[Optimizer], LRScheduler]
    ) -> PipelinedLRScheduler:
        """`factory` builds one scheduler for one stage's optimizer; all follow the same schedule."""
        return cls({s: factory(opt) for s, opt in optimizer.optimizers.items()}, optimizer)

    def set_base_lr(self, lr: float) -> None:
        """Change the schedule's peak: every group's base LR becomes `lr`, its current LR scales with it, so
        the schedule continues from where it is (a warmup at 50% stays at 50% of the new value)."""
        for scheduler in self.schedulers.values():
            for i, group in enumerate(scheduler.optimizer.param_groups):
                ratio = lr / scheduler.base_lrs[i]
                scheduler.base_lrs[i] = lr
                group["lr"] *= ratio

    def step(self) -> None:
        for scheduler in self.schedulers.values():
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        return [float(lr) for scheduler in self.schedulers.values() for lr in scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return {str(s): scheduler.state_dict() for s, scheduler in self.schedulers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        _check_stages("LR scheduler", self.schedulers, state)
        for s, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state[str(s)])

    def positional_state(self) -> list[dict[str, Any]]:
        """Per-stage states in stage order, without stage indices: every stage follows the same schedule, so
        one rank's list restores the schedulers of any rank holding as many stages (the engine checkpoint)."""
        return [scheduler.state_dict() for scheduler in self.schedulers.values()]

    def load_positional_state(self, states: Sequence[Mapping[str, Any]]) -> None:
        if len(states) != len(self.schedulers):
            # A resume that changes the stages per rank (1F1B → ZBV): the saved stages followed one
            # schedule, so their states are equal and any of them restores every stage here.
            if not states or any(dict(state) != dict(states[0]) for state in states[1:]):
                raise ValueError(
                    f"the checkpoint holds {len(states)} LR scheduler states, this rank has "
                    f"{len(self.schedulers)} stages with a scheduler (lr_scheduler added or removed since?)"
                )
            states = [states[0]] * len(self.schedulers)
        for scheduler, state in zip(self.schedulers.values(), states, strict=True):
            scheduler.load_state_dict(dict(state))


def _fused_adam(opt: Optimizer) -> bool:
    return type(opt) in (torch.optim.Adam, torch.optim.AdamW) and bool(opt.defaults.get("fused"))


def _fused_adam_with_state(opt: Optimizer) -> bool:
    return _fused_adam(opt) and all(p in opt.state for group in opt.param_groups for p in group["params"])


# Fused Adam over DTensor parameters (FSDP, HSDP, TP, EP shards) on each rank's local shards.
#
# `Adam.step` hands its lists of DTensors to one `_fused_adam_` call, and DTensor's dispatcher then works out
# the op's sharding over every argument before it runs the same kernel on the local tensors: 11.9 ms of host
# time per step for Qwen3-0.6B's 310 parameter tensors on an H200 host (torch 2.11), 6.0 ms on the shards,
# 4.7 ms over plain tensors (benchmarks/optimizer_host.py). Adam is elementwise, and a parameter,
# its gradient and its moments share one layout (the moments are created as `zeros_like(param)`), so the
# update on the local shards is the same kernel on the same tensors: bitwise the step `Adam.step` takes. The
# moments stay DTensors in `opt.state` (checkpoints reshard them as before); only the update reads their
# local tensors. The first step, which creates the state, goes through `Adam.step`.


def _sharded_alike(opt: Optimizer) -> bool:
    """Every parameter with a gradient is a DTensor whose gradient has its mesh and placements (not a
    pending Partial sum), and none is complex: the update can run on the local shards. False where there
    is no DTensor at all (`Adam.step` has no dispatch to skip there)."""
    found = False
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            if not isinstance(p, DTensor) or torch.is_complex(p):
                return False
            grad = p.grad
            if not (
                isinstance(grad, DTensor)
                and grad.device_mesh == p.device_mesh
                and grad.placements == p.placements
            ):
                return False
            found = True
    return found


def _fused_adam_step_on_shards(
    opt: Optimizer, *, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None
) -> None:
    """`Adam.step` of a fused Adam/AdamW whose state exists, on the local shards (see above)."""
    for group in opt.param_groups:
        lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = lists
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt.state[p]
            params.append(local_tensor(p))
            grads.append(local_tensor(p.grad))
            # (a moment that is not a DTensor like its parameter would fail the kernel's shape check)
            exp_avgs.append(local_tensor(state["exp_avg"]))
            exp_avg_sqs.append(local_tensor(state["exp_avg_sq"]))
            if group["amsgrad"]:
                max_exp_avg_sqs.append(local_tensor(state["max_exp_avg_sq"]))
            steps.append(local_tensor(state["step"]))  # a plain tensor as Adam creates it
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            amsgrad=group["amsgrad"],
            has_complex=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=grad_scale,
            found_inf=found_inf,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )
