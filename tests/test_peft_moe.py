"""LoRA on grouped experts (per-expert A [E, in, r], B [E, r, out]) on a tiny d9d Qwen3-MoE, CPU."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import d9d.models as dm
from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.modules.moe import EagerGroupedMM, GroupedExperts, MoELayer, TopKRouter, TorchGroupedMM
from d9d.parallel.expert import AllToAllBackendConfig, parallelize_expert_parallel
from d9d.peft import (
    EXPERT_PROJECTIONS,
    LoRA,
    LoRAConfig,
    LoRAGroupedExperts,
    inject_and_freeze,
    merge,
    merged,
)
from tests.harness import RankEnv, run_distributed

CONFIG = dm.Qwen3MoEConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    mlp_only_layers=(1,),
    attention_backend="eager",
    grouped_mm="eager",
    initializer_range=0.1,  # decisive routing: merging must not flip a near-tie between experts
)
TARGETS = r".*\.experts\.(gate_proj|down_proj)|.*\.q_proj"


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (4, 9), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("projections", [("up_proj", "down_proj"), ("gate_proj",), EXPERT_PROJECTIONS])
def test_grouped_lora_matches_a_per_expert_float64_reference(projections: tuple[str, ...]) -> None:
    """Gate and up are the two halves of the fused `gate_up_proj`: each adapter updates its own half only,
    in forward and when merged."""
    torch.manual_seed(0)
    base = GroupedExperts(3, 8, 6, grouped_mm=EagerGroupedMM()).to(torch.float64)
    gate, up = base.gate_up_proj.detach().clone().chunk(2, dim=-1)
    weights = {"gate_proj": gate, "up_proj": up, "down_proj": base.down_proj.detach().clone()}
    lora = LoRAGroupedExperts(base, list(projections), rank=2, alpha=5.0)
    assert lora.gate_up_proj is base.gate_up_proj and lora.down_proj is base.down_proj
    adapters = [f"{p}_lora_{f}" for p in projections for f in "AB"]
    assert list(lora.state_dict()) == ["gate_up_proj", "down_proj", *adapters]
    shapes = {"gate_proj": (8, 6), "up_proj": (8, 6), "down_proj": (6, 8)}
    for p in projections:
        d_in, d_out = shapes[p]
        assert getattr(lora, f"{p}_lora_A").shape == (3, d_in, 2)
        assert getattr(lora, f"{p}_lora_B").shape == (3, 2, d_out)
    with torch.no_grad():
        for p in projections:
            getattr(lora, f"{p}_lora_B").normal_()
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 8, dtype=torch.float64)
    dy = torch.randn(5, 8, dtype=torch.float64)
    ref_factors = {n: getattr(lora, n).detach().clone().requires_grad_() for n in adapters}
    x_ref, x_lora = x.clone().requires_grad_(), x.clone().requires_grad_()

    def factor(p: str, e: int) -> torch.Tensor:
        if p not in projections:
            return weights[p][e]
        return weights[p][e] + 2.5 * ref_factors[f"{p}_lora_A"][e] @ ref_factors[f"{p}_lora_B"][e]

    rows = []
    for e, chunk in enumerate(x_ref.split(counts.tolist())):
        hidden = F.silu(chunk @ factor("gate_proj", e)) * (chunk @ factor("up_proj", e))
        rows.append(hidden @ factor("down_proj", e))
    expected = torch.cat(rows)
    (expected * dy).sum().backward()
    out = lora(x_lora, counts)
    (out * dy).sum().backward()
    tight = {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(out, expected, **tight)
    torch.testing.assert_close(x_lora.grad, x_ref.grad, **tight)
    for name, ref in ref_factors.items():
        torch.testing.assert_close(getattr(lora, name).grad, ref.grad, **tight, msg=name)
    expected = expected.detach()
    folded = lora.merged_module()
    assert type(folded) is GroupedExperts and folded is base
    torch.testing.assert_close(folded(x, counts), expected, rtol=1e-12, atol=1e-12)
    assert isinstance(folded, GroupedExperts)
    merged_weights = dict(zip(("gate_proj", "up_proj"), folded.gate_up_proj.chunk(2, dim=-1), strict=True))
    merged_weights["down_proj"] = folded.down_proj
    for p, w in merged_weights.items():
        if p not in projections:  # an untargeted projection merges to exactly its base weight
            assert torch.equal(w, weights[p]), p


def test_expert_lora_trains_only_adapters_and_merges() -> None:
    torch.manual_seed(0)
    model = dm.Qwen3MoEForCausalLM(CONFIG)
    reference = copy.deepcopy(model)
    base_keys = list(model.state_dict())
    result = inject_and_freeze(model, LoRA(LoRAConfig(target_modules=TARGETS, rank=4, alpha=8.0)))
    experts = model.model.layers["0"].mlp.experts
    assert isinstance(experts, LoRAGroupedExperts) and experts.projections == ("gate_proj", "down_proj")
    assert isinstance(model.model.layers["1"].mlp.down_proj, nn.Linear)  # dense layer: not a target
    assert "model.layers.0.mlp.experts.gate_proj_lora_A" in result.trainable
    assert torch.equal(model(input_ids=_ids())["logits"], reference(input_ids=_ids())["logits"])

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    losses = []
    for step in range(8):
        ids = _ids(seed=step % 2)
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-2] < 0.9 * losses[0], losses
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == result.trainable  # every adapter moved, nothing else did

    adapted = model(input_ids=_ids())["logits"]
    with merged(model):
        assert list(model.state_dict()) == base_keys
        torch.testing.assert_close(model(input_ids=_ids())["logits"], adapted, rtol=1e-5, atol=1e-5)
    merge(model)
    assert type(model.model.layers["0"].mlp.experts) is GroupedExperts
    torch.testing.assert_close(model(input_ids=_ids())["logits"], adapted, rtol=1e-5, atol=1e-5)


def test_merged_moe_exports_and_reloads_in_hf_format(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = dm.Qwen3MoEForCausalLM(CONFIG)
    inject_and_freeze(model, LoRA(LoRAConfig(target_modules=TARGETS, rank=2)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    adapted = model(input_ids=_ids())["logits"]
    with merged(model):
        dm.save_pretrained(model, tmp_path / "merged")
    reloaded = dm.from_pretrained(
        tmp_path / "merged", config_overrides={"attention_backend": "eager", "grouped_mm": "eager"}
    )
    torch.testing.assert_close(reloaded(input_ids=_ids())["logits"], adapted, rtol=1e-5, atol=1e-5)


def _expert_parallel_lora(env: RankEnv) -> None:
    """Expert parallelism shards the per-expert factors with the weights (`Shard(0)`): each rank's
    tokens get the same outputs and factor gradients as the whole layer in one process."""
    torch.manual_seed(0)
    moe = MoELayer(
        TopKRouter(8, num_experts=4, top_k=2),
        GroupedExperts(4, 8, 6, grouped_mm=EagerGroupedMM()),
    ).to(torch.float64)
    inject_and_freeze(moe, LoRA(LoRAConfig(target_modules=r"experts\.(up_proj|down_proj)", rank=2)))
    with torch.no_grad():
        moe.experts.up_proj_lora_B.normal_()
        moe.experts.down_proj_lora_B.normal_()
    reference = copy.deepcopy(moe)
    xs = [
        torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(2)
    ]
    expected = [reference(x) for x in xs]
    torch.cat(expected).sum().backward()

    ctx = DistributedContext.create(
        DeviceMeshParameters(expert_parallel=2, data_parallel_shard=2), backend="gloo"
    )
    parallelize_expert_parallel(
        moe,
        ctx.mesh_for(MeshDomain.EXPERT)["ep_shard"],
        device=ctx.device,
        dtype=torch.float32,
        backend=AllToAllBackendConfig(),
    )
    out = moe(xs[env.rank])
    torch.testing.assert_close(out, expected[env.rank], rtol=1e-12, atol=1e-12)
    out.sum().backward()
    for name in ("up_proj_lora_A", "up_proj_lora_B", "down_proj_lora_A", "down_proj_lora_B"):
        param = getattr(moe.experts, name)
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
        want = getattr(reference.experts, name).grad.chunk(2)[env.rank]
        torch.testing.assert_close(param.grad.to_local(), want, rtol=1e-10, atol=1e-12)


@pytest.mark.distributed
def test_expert_lora_under_expert_parallelism() -> None:
    run_distributed(_expert_parallel_lora, 2, timeout=120)


@pytest.mark.gpu
def test_expert_lora_on_the_torch_grouped_mm_backend() -> None:
    """bf16 on CUDA through `torch._grouped_mm` (rank 8: 16-byte aligned factor rows) against the same
    adapted experts computed in float32 with the per-expert loop, forward and factor gradients."""
    torch.manual_seed(0)
    base = GroupedExperts(4, 64, 32, grouped_mm=TorchGroupedMM()).to("cuda", torch.bfloat16)
    lora = LoRAGroupedExperts(base, EXPERT_PROJECTIONS, rank=8, alpha=16.0)
    with torch.no_grad():
        for name in lora.adapter_parameter_names():
            if name.endswith("_B"):
                getattr(lora, name).normal_(std=0.1)
    reference = copy.deepcopy(lora).float()
    reference.grouped_mm = EagerGroupedMM()
    counts = torch.tensor([5, 0, 7, 4], device="cuda")
    x = torch.randn(16, 64, device="cuda")
    out = lora(x.bfloat16(), counts)
    expected = reference(x, counts)
    torch.testing.assert_close(out.float(), expected, rtol=3e-2, atol=3e-2)
    out.float().square().sum().backward()
    expected.square().sum().backward()
    for name in lora.adapter_parameter_names():
        got, want = getattr(lora, name).grad, getattr(reference, name).grad
        torch.testing.assert_close(got.float(), want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))
