"""Global gradient norm and clipping over tensor shards, replicas and pipeline stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from d9d.parallel import clip_grad_norm_, global_grad_norm
from tests.harness import RankEnv, run_distributed

pytestmark = pytest.mark.distributed

# Per pipeline stage: name -> (full shape, placement on the tp mesh, or None for a plain tensor).
LAYOUT = {
    "rows": ((6, 4), Shard(0)),
    "uneven_cols": ((3, 5), Shard(1)),  # 3 and 2 columns
    "replicated": ((5,), Replicate()),
    "plain": ((3, 3), None),
}


def _full_grads(stage: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(stage)
    return {name: torch.randn(shape, generator=g, dtype=torch.float64) for name, (shape, _) in LAYOUT.items()}


def _params(stage: int, tp_mesh) -> list[nn.Parameter]:  # type: ignore[no-untyped-def]
    out = []
    for name, grad in _full_grads(stage).items():
        placement = LAYOUT[name][1]
        if placement is None:
            p = nn.Parameter(torch.zeros_like(grad))
            p.grad = grad.clone()
        else:
            p = nn.Parameter(distribute_tensor(torch.zeros_like(grad), tp_mesh, [placement]))
            p.grad = distribute_tensor(grad.clone(), tp_mesh, [placement])
        out.append(p)
    return out


def _norms(env: RankEnv) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage = env.rank // 2
    pp_group = mesh.get_group("pp")
    all_full = [g for s in (0, 1) for g in _full_grads(s).values()]
    for norm_type in (2.0, 1.0, 3.0, float("inf")):
        params = _params(stage, mesh["tp"])
        want = torch.nn.utils.get_total_norm(all_full, norm_type)
        got = global_grad_norm(params, norm_type=norm_type, pp_group=pp_group)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0, msg=f"norm_type={norm_type}")
        # Without the pp group only this stage counts.
        stage_only = torch.nn.utils.get_total_norm(list(_full_grads(stage).values()), norm_type)
        torch.testing.assert_close(
            global_grad_norm(params, norm_type=norm_type).double(), stage_only, rtol=1e-6, atol=0
        )

    # Clipping: the same coefficient as torch's on the full gradients of both stages.
    params = _params(stage, mesh["tp"])
    reference = [nn.Parameter(torch.zeros_like(g)) for g in all_full]
    for p, g in zip(reference, all_full, strict=True):
        p.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(reference, 2.0)
    got_norm = clip_grad_norm_(params, 2.0, pp_group=pp_group)
    torch.testing.assert_close(got_norm.double(), want_norm, rtol=1e-6, atol=0)
    mine = reference[4 * stage : 4 * stage + 4]
    for p, ref in zip(params, mine, strict=True):
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        torch.testing.assert_close(full, ref.grad, rtol=1e-6, atol=1e-9)

    # An unreduced (Partial) gradient has no meaningful local norm.
    bad = nn.Parameter(distribute_tensor(torch.zeros(2), mesh["tp"], [Replicate()]))
    bad.grad = DTensor.from_local(torch.ones(2), mesh["tp"], [Partial()])
    with pytest.raises(ValueError, match="Partial"):
        global_grad_norm([bad])


def test_global_norm_and_clipping_across_tp_and_pp() -> None:
    run_distributed(_norms, 4, timeout=120)
