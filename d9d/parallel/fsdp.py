"""Fully sharded data parallelism on FSDP2 (`fully_shard`), and HSDP on top of the gradient synchronizer.

FSDP2 shards parameters over the shard mesh, all-gathers them around each unit's forward/backward and
reduce-scatters gradients. It is configured to *sum* (gradient divide factor 1, sum-only collectives),
because normalization belongs to the synchronizer's loss-weight step, which also keeps gloo working (it
has no AVG or PREMUL_SUM).

HSDP: FSDP's own replicate support would all-reduce inside FSDP with its own averaging. Instead FSDP
only gets the shard mesh, and each sharded parameter is recorded for reduction over the replicate mesh.
FSDP2 calls post-accumulate-grad hooks on the sharded parameter right after its reduce-scatter, so the
synchronizer's bucket all-reduce over the replicate mesh starts during backward, exactly as for
replicated parameters.

Parameters whose gradient reduction is already decided (experts sharded by expert parallelism) are
passed to FSDP as ignored: they live on the expert mesh, which FSDP cannot combine with the dense one.

`FSDPConfig` tunes the collectives (docs/parallelism.md, "FSDP settings"):

- `reshard_after_forward` (`auto`): `always` frees every gathered unit after its forward and gathers it
  again in backward; `never` keeps all of them gathered from forward to backward; `auto` does what `never`
  does when the module's gathered parameters fit in `keep_gathered_gib` (a small model: the backward
  all-gathers cost more time than the memory is worth), and otherwise keeps the root (gathered first,
  reduced last) and the last unit (backward starts with it, so a re-gather could overlap nothing) and
  reshards the others, whose backward all-gather is prefetched behind the backward of the unit after them.
  Pipeline steps keep every unit gathered regardless (`d9d.pipeline.runtime.sharding`); the policy then
  governs forward-only programs.
- `reduce_dtype` (None: the parameters' dtype): `float32` makes FSDP cast bf16 gradients up before its
  reduce-scatter (FSDP2 `MixedPrecisionPolicy(reduce_dtype=...)`; parameters stay as they are) and casts
  the sum back to the parameter dtype for the optimizer. The sharded parameters are recorded with that
  dtype (`mark_grad_reduce_dtype`), so the synchronizer accumulates microbatches and all-reduces HSDP's
  replicas in it as well. Experts under expert parallelism are not FSDP's (passed as ignored): their
  gradients keep the synchronizer's own dtype.
- `forward_prefetch` / `backward_prefetch`: how many next units a unit's all-gather starts ahead of their
  turn (FSDP2's `set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`). 0 / 1 leave FSDP2's
  implicit behaviour: a unit is gathered in forward when its own forward begins, and backward prefetches the
  next unit in reverse forward order.
- `layers_per_unit` (`auto`): how many consecutive decoder layers the decoder plan (`fsdp_units`) makes
  one unit (`fully_shard` of a list of modules: one all-gather, one reduce-scatter and one set of FSDP's
  hooks for all of them). Each unit costs the host its pre-forward, post-forward, pre-backward and
  post-backward work, which on a fast GPU outlasts a small layer's compute: the GPU then waits for the
  host between units. Fewer, larger units trade that host time for larger gathers in flight (more memory
  when units are resharded) and a larger first all-gather and last reduce-scatter that nothing hides.
  `auto` groups `AUTO_LAYERS_PER_UNIT` layers when every unit stays gathered from forward to backward
  (the memory is then the same whatever the grouping) and one layer per unit otherwise. 2 x H200, FSDP 2:
  Qwen3-0.6B 1.12x and the benchmark MoE 1.05x the tokens/s of one layer per unit (docs/benchmarks.md,
  session 25). `parallelize_fsdp` itself takes the units it is given: an entry of `units` that is a list
  of modules is one unit.
- `reduce_every` (`auto`): under gradient accumulation without pipelining (several microbatches per rank
  and step), `microbatch` lets FSDP reduce-scatter each microbatch's gradients and reshard after each
  backward (the next microbatch gathers again); `step` keeps every unit gathered through the step,
  accumulates the unsharded gradients (in FSDP's reduce dtype) and reduce-scatters each unit once, in the
  last microbatch's backward (`d9d.pipeline.runtime.sharding.StageSharding`; pipeline steps always reduce
  once per step, after a stage's last backward): one all-gather and one reduce-scatter per unit and step
  instead of one of each per microbatch, for the gathered parameters and an unsharded gradient held
  through the step. `auto` is `step` where the units stay
  gathered anyway (`keeps_units_gathered`) and the gradient synchronizer would not accumulate wider than
  FSDP does (`gradient_manager.grad_dtype`), else `microbatch`.

A unit kept gathered after forward stays gathered until its backward, and the module then holds the
gathered parameters in place of the sharded ones. A forward that no backward follows (evaluation,
inference: run without grad) therefore reshards every unit when the root's forward ends, so memory and the
parameters that `module.parameters()` returns are those of a sharded model again. After a forward *with*
grad that is not followed by backward (a probe), call `reshard_fsdp(module)` before building an optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from d9d.parallel.grad_sync import is_grad_reduce_marked, mark_grad_reduce_dtype, mark_grad_reduce_mesh

ReshardPolicy = Literal["auto", "always", "never"]
ReduceEvery = Literal["auto", "microbatch", "step"]
GIB = 1 << 30
# `layers_per_unit: auto`'s grouping of units kept gathered. 2 x H200, FSDP 2 (docs/benchmarks.md, session
# 25): 2, 4 and 8 layers per unit gave Qwen3-0.6B 1.06x, 1.12x and 1.14x one layer's tokens/s, the benchmark
# MoE 1.06x, 1.05x and 1.08x; 4 is within the noise of 8 with half of its gather and reduction exposed at
# the ends of the step.
AUTO_LAYERS_PER_UNIT = 4
logger = logging.getLogger(__name__)


class FSDPConfig(BaseModel):
    """How FSDP gathers parameters and reduces gradients (a job config's `model.options.parallel.fsdp`).

    - `reshard_after_forward`: `auto` (default) keeps every unit gathered from forward to backward when
      the model's (pipeline stage's) gathered parameters take at most `keep_gathered_gib`, and otherwise
      keeps the root and the last unit (the head, or a stage's last layer) gathered and frees the other
      units after their forward; `always` frees every unit, root included (the least memory, one more
      all-gather per unit); `never` keeps every unit gathered until its backward (no re-gather, the most
      memory).
    - `keep_gathered_gib`: `auto`'s size limit (GiB of parameters, gathered, on one rank: tensor-parallel
      shards count as local; experts under expert parallelism are not FSDP's). 0 turns the rule off.
    - `reduce_dtype`: the dtype of the gradient reduce-scatter (and of HSDP's replica all-reduce);
      null (default) is the parameters' dtype. `float32` sums bf16 gradients in float32 (one rounding to
      bf16 instead of one per summand) at twice the bytes on the wire.
    - `forward_prefetch`: how many next units each unit's forward starts gathering (0: FSDP2's implicit
      gather at each unit's own forward).
    - `backward_prefetch`: how many next units (in backward order) each unit's backward starts gathering
      (1: FSDP2's implicit prefetch of the next one).
    - `layers_per_unit`: consecutive decoder layers per FSDP unit; `auto` (default) groups 4 when every
      unit stays gathered from forward to backward (see `reshard_after_forward`) and 1 otherwise. Fewer
      units cost the host fewer FSDP hooks per step; each unit's gather and reduction grows with it.
    - `reduce_every`: with several microbatches per rank and step (no pipeline), `microbatch` reduces the
      gradients after every microbatch's backward, `step` once after the last (the parameters stay
      gathered and the gradients unsharded through the step; pipeline steps always do this); `auto`
      (default) is `step` when the units stay gathered anyway and `gradient_manager.grad_dtype` is not
      wider than FSDP's reduce dtype, else `microbatch`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    reshard_after_forward: ReshardPolicy = "auto"
    reduce_dtype: Literal["bfloat16", "float32"] | None = None
    forward_prefetch: int = Field(0, ge=0)
    backward_prefetch: int = Field(1, ge=1)
    # 4 GiB: a model of about 2B parameters in bf16. Qwen3-0.6B (1.1 GiB gathered), FSDP 4 on 4 × H200:
    # kept gathered, 1.11× the resharding step's tokens/s for 1.1 GiB more per GPU (docs/parallelism.md).
    keep_gathered_gib: float = Field(4.0, ge=0)
    layers_per_unit: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    reduce_every: ReduceEvery = "auto"

    def keeps_units_gathered(self, gathered_bytes: int) -> bool:
        """Whether every unit stays gathered from forward to backward, for a module whose FSDP parameters
        take `gathered_bytes` on one rank once gathered."""
        match self.reshard_after_forward:
            case "never":
                return True
            case "always":
                return False
            case "auto":
                return gathered_bytes <= self.keep_gathered_gib * GIB

    def resolve_layers_per_unit(self, gathered_bytes: int) -> int:
        """Layers per unit for a module whose FSDP parameters take `gathered_bytes` on one rank gathered."""
        match self.layers_per_unit:
            case "auto":
                return AUTO_LAYERS_PER_UNIT if self.keeps_units_gathered(gathered_bytes) else 1
            case int(layers):
                return layers

    def reduces_once_per_step(self, gathered_bytes: int, *, grad_dtype_wider: bool) -> bool:
        """Whether a step of several microbatches without pipelining reduces FSDP's gradients once, after
        its last backward (`reduce_every`), for a module whose FSDP parameters take `gathered_bytes`
        gathered; `grad_dtype_wider`: the gradient synchronizer would accumulate the microbatches in a dtype
        wider than FSDP's (which only reducing every microbatch leaves to it)."""
        match self.reduce_every:
            case "microbatch":
                return False
            case "step":
                return True
            case "auto":
                return self.keeps_units_gathered(gathered_bytes) and not grad_dtype_wider

    def resolve_reduce_dtype(self) -> torch.dtype | None:
        return None if self.reduce_dtype is None else getattr(torch, self.reduce_dtype)  # type: ignore[no-any-return]


FSDPUnit = nn.Module | list[nn.Module]
"""One FSDP unit: a module, or consecutive modules gathered and reduced as one (`fully_shard` of a list)."""


@dataclasses.dataclass(frozen=True)
class FSDPRoot:
    """What `parallelize_fsdp` made of a module, for whoever drives its steps (`fsdp_root`): the settings,
    its FSDP parameters' gathered bytes on one rank, and the dtype FSDP accumulates and reduces their
    gradients in (the mixed-precision policy's; None: each parameter's own)."""

    config: FSDPConfig
    gathered_bytes: int
    accumulation_dtype: torch.dtype | None


_ROOT_ATTR = "_d9d_fsdp_root"


def fsdp_root(module: nn.Module) -> FSDPRoot | None:
    """`module`'s record if `parallelize_fsdp` (or `parallelize_hsdp`) sharded it, else None."""
    root: FSDPRoot | None = module.__dict__.get(_ROOT_ATTR)
    return root


def _decided_params(unit: FSDPUnit) -> set[nn.Parameter]:
    return {
        param
        for module in (unit if isinstance(unit, list) else [unit])
        for sub in module.modules()
        for name, param in sub.named_parameters(recurse=False)
        if is_grad_reduce_marked(sub, name)
    }


def _mixed_precision(
    mp_policy: MixedPrecisionPolicy | None, reduce_dtype: torch.dtype | None
) -> MixedPrecisionPolicy:
    policy = mp_policy or MixedPrecisionPolicy()
    if reduce_dtype is None:
        return policy
    if policy.reduce_dtype is not None and policy.reduce_dtype != reduce_dtype:
        raise ValueError(
            f"fsdp.reduce_dtype={reduce_dtype} contradicts the mixed-precision policy's reduce_dtype="
            f"{policy.reduce_dtype}; set one of them"
        )
    return dataclasses.replace(policy, reduce_dtype=reduce_dtype)


def gathered_bytes(params: Iterable[nn.Parameter], param_dtype: torch.dtype | None = None) -> int:
    """Bytes `params` take on one rank once FSDP has gathered them (a tensor-parallel DTensor: its shard),
    floating-point ones in `param_dtype` when the mixed-precision policy sets one."""
    total = 0
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        dtype = param_dtype if param_dtype is not None and local.is_floating_point() else local.dtype
        total += local.numel() * dtype.itemsize
    return total


def fsdp_gathered_bytes(module: nn.Module, param_dtype: torch.dtype | None = None) -> int:
    """Bytes of `module`'s parameters that FSDP would shard (not those expert parallelism already
    placed), on one rank once gathered: what `FSDPConfig.keeps_units_gathered` is asked about."""
    decided = _decided_params(module)
    return gathered_bytes((p for p in module.parameters() if p not in decided), param_dtype)


def reshard_units(config: FSDPConfig, count: int, gathered: int) -> tuple[list[bool], bool]:
    """(reshard after forward, per unit in forward order; for the root), for `count` units of a model
    whose FSDP-sharded parameters take `gathered` bytes once gathered (the dry run asks it too)."""
    if config.keeps_units_gathered(gathered):
        if config.reshard_after_forward == "auto":
            logger.info(
                "fsdp reshard_after_forward auto: the gathered parameters take %.2f GiB <= keep_gathered_gib "
                "%g, so every unit stays gathered from forward to backward",
                gathered / GIB,
                config.keep_gathered_gib,
            )
        return [False] * count, False
    if config.reshard_after_forward == "always":
        return [True] * count, True
    # auto above the size limit: backward begins with the last unit; re-gathering it there could overlap
    # nothing. The root is gathered before the first unit and reduced after it, so freeing it in between
    # saves nothing.
    return [i < count - 1 for i in range(count)], False


def _set_prefetch(root: FSDPModule, units: list[FSDPModule], forward: int, backward: int) -> None:
    """Each module of the forward chain (root, units in order) prefetches the next `forward`; each of the
    backward chain (root, units reversed: the root's pre-backward fires first) the next `backward`."""
    if forward > 0:
        chain = [root, *units]
        for i, module in enumerate(chain[:-1]):
            module.set_modules_to_forward_prefetch(chain[i + 1 : i + 1 + forward])
    if backward > 1:
        chain = [root, *reversed(units)]
        for i, module in enumerate(chain[:-1]):
            module.set_modules_to_backward_prefetch(chain[i + 1 : i + 1 + backward])


def reshard_fsdp(module: nn.Module) -> None:
    """Free every gathered FSDP unit of `module`: the sharded parameters are registered again."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def _reshard_without_grad(module: nn.Module, _args: object, _output: object) -> None:
    if not torch.is_grad_enabled():
        reshard_fsdp(module)


def parallelize_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Iterable[FSDPUnit] = (),
    replicate_mesh: DeviceMesh | None = None,
    config: FSDPConfig | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Shard `module`'s parameters over the 1-D `mesh` (e.g. the dense domain's `dp_cp_shard`).

    `units` (e.g. the embedding, the decoder layers and the head), in the order forward runs them, each
    become one FSDP group, gathered just for their own compute (an entry that is a list of modules: one
    group for all of them); whatever they do not cover belongs to the root group. The order is what
    `config`'s reshard policy (`auto`: the last unit stays gathered) and prefetching follow
    (`config.layers_per_unit` is for whoever makes the units: the decoder plan's `fsdp_units`). With
    `replicate_mesh`, shards are replicated over it and their gradients summed by the synchronizer (that
    is HSDP; see `parallelize_hsdp`). `mp_policy` is FSDP2's; `config.reduce_dtype` fills its
    `reduce_dtype` (a contradicting pair is refused).
    """
    if mesh.ndim != 1:
        raise ValueError(f"parallelize_fsdp needs a 1-D shard mesh, got dims {mesh.mesh_dim_names}")
    config = config or FSDPConfig()
    units = list(units)
    policy = _mixed_precision(mp_policy, config.resolve_reduce_dtype())
    gathered = fsdp_gathered_bytes(module, policy.param_dtype)
    unit_reshard, root_reshard = reshard_units(config, len(units), gathered)
    sharded: list[FSDPModule] = []
    for unit, reshard in [*zip(units, unit_reshard, strict=True), (module, root_reshard)]:
        sharded_unit = fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard,
            mp_policy=policy,
            ignored_params=_decided_params(unit) or None,
        )
        # A list's modules share one FSDP state: the first one stands for the unit.
        fsdp_module = sharded_unit[0] if isinstance(sharded_unit, list) else sharded_unit
        fsdp_module.set_gradient_divide_factor(1.0)
        fsdp_module.set_force_sum_reduction_for_comms(True)
        sharded.append(fsdp_module)
    _set_prefetch(sharded[-1], sharded[:-1], config.forward_prefetch, config.backward_prefetch)
    if not all([*unit_reshard, root_reshard]):
        # Registered after FSDP's own hooks: runs once the root's post-forward is done.
        module.register_forward_hook(_reshard_without_grad)
    # FSDP2 reduces in the parameter dtype of its mixed-precision policy when no reduce dtype is set.
    module.__dict__[_ROOT_ATTR] = FSDPRoot(config, gathered, policy.reduce_dtype or policy.param_dtype)
    for sub in module.modules():
        for name, _ in sub.named_parameters(recurse=False):
            if not is_grad_reduce_marked(sub, name):
                mark_grad_reduce_mesh(sub, name, replicate_mesh)
                if policy.reduce_dtype is not None:
                    mark_grad_reduce_dtype(sub, name, policy.reduce_dtype)


def parallelize_hsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Iterable[FSDPUnit] = (),
    config: FSDPConfig | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Hybrid sharding over a 2-D `(replicate, shard)` mesh, e.g. the dense domain's
    `("dp_cp_replicate", "dp_cp_shard")`: FSDP over the second dim, replicas over the first."""
    names = mesh.mesh_dim_names
    if mesh.ndim != 2 or names is None:
        raise ValueError(f"parallelize_hsdp needs a named 2-D (replicate, shard) mesh, got dims {names}")
    parallelize_fsdp(
        module,
        mesh[names[1]],
        units=units,
        replicate_mesh=mesh[names[0]],
        config=config,
        mp_policy=mp_policy,
    )
