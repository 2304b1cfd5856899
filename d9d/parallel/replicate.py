"""Data parallelism by replication: every rank holds the full weights, gradients are summed across.

Composition rather than a wrapper: `parallelize_replicate` only changes how parameters are stored and
records where their gradients must be reduced; the reduction itself is done by `GradientSynchronizer`,
which also serves FSDP shards and experts.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from d9d.parallel.grad_sync import (
    is_grad_reduce_marked,
    mark_grad_reduce_mesh,
    mark_undecided_grad_reduction,
)
from d9d.parallel.local_params import compute_with_local_parameters, forward_triggers


def replicate_plain(module: nn.Module, mesh: DeviceMesh) -> None:
    """Sum the gradients of every parameter of `module` (recursively) that no strategy has decided yet over
    all ranks of `mesh`, keeping the parameters plain tensors.

    For a model with no DTensor parameter at all (replicas alone, or with pipeline stages): nothing needs
    a layout, and as DTensors every block's forward would swap in each parameter's local view
    (`to_local`, an autograd node whose backward builds a DTensor gradient) and autograd would accumulate
    DTensor gradients, for every parameter and microbatch. On 2 × H200 with 2-sequence microbatches that
    host work made two replicas slower than one GPU (docs/benchmarks.md, session 30). Ranks must hold
    identical values, as for `parallelize_replicate`; checkpoints write a plain tensor held under one key
    by several ranks once (DCP's replicated-tensor deduplication; `StateWriter`'s lowest rank)."""
    mark_undecided_grad_reduction(module, mesh)


def parallelize_replicate(module: nn.Module, mesh: DeviceMesh, *, units: Sequence[nn.Module] = ()) -> None:
    """Replicate every parameter of `module` (recursively) over all ranks of `mesh`.

    - A plain parameter becomes a DTensor replicated on `mesh`; its module's forward sees the local tensor.
    - A parameter that already is a DTensor (placed by tensor parallelism on another mesh) keeps its layout
      and forward behaviour; it is only recorded for gradient reduction over `mesh`.
    - A parameter whose gradient reduction is already decided (experts, see `parallelize_expert_parallel`)
      is left alone, so the whole model can be replicated after the experts were sharded.

    Ranks must hold identical values (same seed, or weights loaded afterwards): nothing is broadcast.

    `units` (e.g. the decoder blocks) swap the local views of every parameter below them once, around
    their own forward, instead of around each submodule's: fewer hooks per step, and a compiled block
    (d9d.parallel.compile runs a block's own hooks eagerly) then traces plain tensors, not per-module
    hooks whose guards differ from block to block and would recompile every block.
    """
    replaced: dict[int, nn.Parameter] = {}  # keeps parameters shared between modules shared
    triggers = forward_triggers(module)
    for unit in units:
        for sub in unit.modules():
            triggers[id(sub)] = [unit]
    for sub in module.modules():
        converted: set[str] = set()
        for name, param in list(sub.named_parameters(recurse=False)):
            if is_grad_reduce_marked(sub, name):
                continue
            if not isinstance(param, DTensor):
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(
                        DTensor.from_local(param.detach(), mesh, [Replicate()] * mesh.ndim, run_check=False),
                        requires_grad=param.requires_grad,
                    )
                sub.register_parameter(name, replaced[id(param)])
                converted.add(name)
            mark_grad_reduce_mesh(sub, name, mesh)
        if converted:
            compute_with_local_parameters(sub, converted, triggers=triggers[id(sub)])
