"""The job's `activation_checkpointing:` section: a discriminated union on `mode`, resolved to per-layer
choices by `plan_layers` and applied to a stage by `apply_activation_checkpointing`.

Layer indices are the model's global ones (`layers.<i>` in state dicts), whichever pipeline stage holds a
layer: `every: 2` recomputes layers 0, 2, 4, ... of the whole model (with `ops` as well, the odd ones are
op-level), so a stage's share does not depend on how the layers were split.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Literal, Protocol, Self, assert_never, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from d9d.modules.checkpointing.activation import OpKind, SaveOps


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NoActivationCheckpointing(_Frozen):
    """Every layer keeps what its backward needs (the fastest, the most memory)."""

    mode: Literal["none"] = "none"


class FullActivationCheckpointing(_Frozen):
    """Every decoder layer keeps only its input; backward replays the layer's forward first (about one more
    forward of compute for the least activation memory)."""

    mode: Literal["full"] = "full"


class SelectiveActivationCheckpointing(_Frozen):
    """Layer-level, op-level, or both:

    - `every: k`: whole-layer checkpointing of every k-th layer (global indices 0, k, 2k, ...; `every: 1` is
      `full`); the other layers keep everything.
    - `ops: [matmul, attention]`: in every layer, keep the outputs of these ops (matrix products: projections,
      MLPs, experts; attention kernels) and of collectives, and recompute the cheap rest (norms, activation
      functions, rotary, casts) in backward.
    - both: every k-th layer is recomputed whole (keeps only its input), every other layer uses the op-level
      policy. The op-level policy saves the most memory per recompute cost (it recomputes the cheap ops only),
      yet every layer still keeps the matmul/attention outputs; whole-layer recompute of every k-th layer
      drops them there too: less memory than either alone, for little more recompute than `every: k`.
    """

    mode: Literal["selective"] = "selective"
    every: int | None = Field(None, ge=1)
    ops: tuple[OpKind, ...] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _some_kind(self) -> Self:
        if self.every is None and self.ops is None:
            raise ValueError(
                "mode 'selective' takes `every: k` (checkpoint every k-th layer whole), `ops: [matmul, "
                "attention]` (keep these ops' outputs, recompute the rest), or both (every k-th layer whole, "
                "the others op-level)"
            )
        if self.ops is not None and len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops {list(self.ops)} names an op kind twice")
        return self


ActivationCheckpointingConfig = Annotated[
    NoActivationCheckpointing | FullActivationCheckpointing | SelectiveActivationCheckpointing,
    Field(discriminator="mode"),
]


def plan_layers(config: ActivationCheckpointingConfig, layers: Iterable[int]) -> dict[int, SaveOps | None]:
    """The checkpointed layers among `layers` (global indices), each with its op policy (None: the whole
    layer is recomputed)."""
    match config:
        case NoActivationCheckpointing():
            return {}
        case FullActivationCheckpointing():
            return dict.fromkeys(layers)
        case SelectiveActivationCheckpointing(every=int() as every, ops=tuple() as ops):
            # the same policy for every op-level layer: the compiled function's guard on its context function
            # (`traced_context_fn`, one per policy) holds across them, so they share one graph
            policy = SaveOps(frozenset(ops))
            return {i: None if i % every == 0 else policy for i in layers}
        case SelectiveActivationCheckpointing(every=int() as every):
            return dict.fromkeys(i for i in layers if i % every == 0)
        case SelectiveActivationCheckpointing(ops=tuple() as ops):
            policy = SaveOps(frozenset(ops))
            return dict.fromkeys(layers, policy)
        case SelectiveActivationCheckpointing():
            raise AssertionError("validated: at least one of every / ops")
        case _:
            assert_never(config)


@runtime_checkable
class CheckpointableStack(Protocol):
    """A stack of decoder layers that checkpoints the ones it is told to (`DecoderBackbone`)."""

    def decoder_layers(self) -> Mapping[int, nn.Module]: ...

    def set_activation_checkpointing(
        self, enabled: bool = True, layers: Iterable[int] | None = None, *, policy: SaveOps | None = None
    ) -> None: ...


def apply_activation_checkpointing(stage: nn.Module, config: ActivationCheckpointingConfig) -> int:
    """Sets every decoder stack in `stage` to `config` (replacing earlier settings); returns how many stacks
    were found (0: the stage has none this can apply to)."""
    stacks = [m for m in stage.modules() if isinstance(m, CheckpointableStack)]
    for stack in stacks:
        indices = list(stack.decoder_layers())
        stack.set_activation_checkpointing(False, indices)
        plan = plan_layers(config, indices)
        for policy in dict.fromkeys(plan.values()):
            stack.set_activation_checkpointing(
                True, [i for i, p in plan.items() if p == policy], policy=policy
            )
    return len(stacks)
