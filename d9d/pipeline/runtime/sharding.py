"""FSDP2 inside a pipeline step: gather a stage once, reduce its gradients once, after its last backward.

(The engine drives a model without pipelining much the same way under gradient accumulation, when
`fsdp.reduce_every` resolves to `step` (`d9d.engine.step.SequentialStepRunner`): there backward is never
split, so instead of `reduce` the last microbatch's backward reduces each unit as it reaches it, through
FSDP's own post-backward hooks (`reduce_in_next_backward`, then `end_step`), overlapping the backward of
the units before it.)

FSDP2 reduce-scatters a module's gradients in a hook on the module's *inputs*, which fires when autograd
reaches them. Under a split backward (ZB1P, ZBV, DualPipeV) that is the input-gradient pass: the weight
gradients come later, in the weight pass, which never reaches the inputs. FSDP would reduce nothing and
reshard the gathered parameters; the weight pass then accumulated into freed, unsharded parameters and
the run trained without most of its gradients.

So a stage that FSDP shards is driven per step, whatever the schedule:

- `begin_step`: gradient sync, resharding after forward and after backward are switched off for every
  FSDP module of the stage. The first forward gathers each unit (with FSDP's own prefetching); it then
  stays gathered through every forward, input pass and weight pass of the step, so the parameters the
  weight pass differentiates are the ones the forward used, and no microbatch gathers again.
- `reduce`: right after the stage's last backward action of the step (the executor knows it from the
  program), every unit's post-backward runs with gradient sync on: one reduce-scatter per unit and step
  (the accumulated unsharded gradients of all microbatches), which also calls the post-accumulate-grad
  hooks of the sharded parameters (the gradient synchronizer's, for HSDP), then reshards. The reduce is
  asynchronous on CUDA and overlaps the other stages' work.
- The configured reshard-after-forward setting is restored, so forward-only programs (evaluation,
  inference) keep their memory policy.

Cost: a stage's parameters stay gathered for the whole step and its gradients accumulate unsharded
(what torchtitan's pipeline + FSDP does too); in exchange each unit is gathered and reduced once per step
instead of once or twice per microbatch.

FSDP2 has no public "reduce now" call; like `torch.distributed.pipelining`, this reaches into the FSDP
state for the post-backward (`_fsdp_param_group` up to torch 2.12, `_fsdp_param_groups` after).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def _param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


class StageSharding:
    """The FSDP units of one stage module, driven once per pipeline step (see the module docs)."""

    def __init__(self, module: nn.Module) -> None:
        # One module per FSDP state: the modules of a unit made of several (`fully_shard` of a list, e.g.
        # `fsdp.layers_per_unit` > 1) share theirs, which must be driven once.
        states: dict[int, FSDPModule] = {}
        for m in module.modules():
            if isinstance(m, FSDPModule):
                states.setdefault(id(fully_shard.state(m)), m)  # type: ignore[attr-defined]
        self._units: list[FSDPModule] = list(states.values())
        self._roots = [m for m in self._units if not _inside_another(m, self._units)]
        self._in_step = False
        self._reducing = False  # between `reduce_in_next_backward` and `end_step`
        self._reshard_after_forward: list[list[Any]] = []

    @classmethod
    def of(cls, module: nn.Module) -> StageSharding | None:
        """None when FSDP shards nothing in `module`."""
        sharding = cls(module)
        return sharding if sharding._units else None

    def reduced_params(self) -> list[torch.Tensor]:
        """The sharded parameters whose gradients `reduce` produces (once per step, not per microbatch)."""
        params: list[torch.Tensor] = []
        for unit in self._units:
            for group in _param_groups(fully_shard.state(unit)):  # type: ignore[attr-defined]
                params.extend(p.sharded_param for p in group.fsdp_params)
        return params

    def begin_step(self) -> None:
        if self._in_step or self._reducing:
            raise RuntimeError("a step began before the previous one reduced its FSDP gradients")
        self._reshard_after_forward = [
            [g.post_forward_mesh_info for g in _param_groups(fully_shard.state(u))]  # type: ignore[attr-defined]
            for u in self._units
        ]
        for unit in self._units:
            unit.set_requires_gradient_sync(False, recurse=False)
            unit.set_reshard_after_forward(False, recurse=False)
            unit.set_reshard_after_backward(False, recurse=False)
            unit.set_is_last_backward(False)
        self._in_step = True

    def reduce_in_next_backward(self) -> None:
        """Let the step's next backward, its last, reduce as FSDP does by itself: each unit's accumulated
        gradients are reduce-scattered as that backward reaches it (overlapping the backward of the units
        before it) and the unit reshards. For a plain backward (no split into input and weight passes);
        `end_step` follows it. The units stay gathered through its forward."""
        if not self._in_step:
            raise RuntimeError("FSDP gradients reduced outside a step")
        self._sync_on()
        self._in_step = False
        self._reducing = True

    def end_step(self) -> None:
        """After the backward that `reduce_in_next_backward` announced: the forward setting restored."""
        if not self._reducing:
            raise RuntimeError("end_step without reduce_in_next_backward")
        self._restore_reshard_after_forward()
        self._reducing = False

    def _sync_on(self) -> None:
        for unit in self._units:
            unit.set_requires_gradient_sync(True, recurse=False)
            unit.set_reshard_after_backward(True, recurse=False)
            unit.set_is_last_backward(True)

    def _restore_reshard_after_forward(self) -> None:
        for unit, saved in zip(self._units, self._reshard_after_forward, strict=True):
            for group, info in zip(_param_groups(fully_shard.state(unit)), saved, strict=True):  # type: ignore[attr-defined]
                group.post_forward_mesh_info = info

    def reduce(self) -> None:
        """Reduce-scatter every unit's accumulated gradients and reshard (after the stage's last backward)."""
        if not self._in_step:
            raise RuntimeError("FSDP gradients reduced outside a step")
        self._sync_on()
        # Last unit first, the order a plain backward reaches them in.
        for unit in reversed(self._units):
            for group in _param_groups(fully_shard.state(unit)):  # type: ignore[attr-defined]
                group.post_backward()
        for root in self._roots:
            fully_shard.state(root)._root_post_backward_final_callback()  # type: ignore[attr-defined]
        self._restore_reshard_after_forward()
        self._in_step = False

    @property
    def in_step(self) -> bool:
        return self._in_step


def _inside_another(module: FSDPModule, units: list[FSDPModule]) -> bool:
    return any(other is not module and any(m is module for m in other.modules()) for other in units)  # type: ignore[attr-defined]
