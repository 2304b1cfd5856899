"""DeepSeek-V3-style MoE: parity with transformers' `DeepseekV3ForCausalLM` (float32, tiny random models with
random norms and expert biases: logits, loss and every gradient within 1e-5), the router against HF's,
Hugging Face import/export with the expert bias kept as `e_score_correction_bias`, the engine's
`deepseek_v3` provider, and the gloo parallel matrix (FSDP × EP, DP × EP, TP, TP + SP, CP × EP, pipeline)
against one process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file
from torch import nn

import d9d.models as dm
from d9d.core import DistributedContext
from d9d.engine.config import parse_config
from d9d.engine.dry_run import dry_run
from d9d.engine.errors import ConfigError
from d9d.engine.preflight import preflight
from d9d.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3ForCausalLM, parallelize_deepseek_v3
from d9d.models.hf import config_from_hf, config_to_hf, d9d_to_hf_mapper
from d9d.modules.moe import TopKRouter
from d9d.parallel.expert import AllToAllBackendConfig
from d9d.parallel.plans import ParallelPlanConfig
from d9d.pipeline.api import PipelineStageInfo
from d9d.state import apply_group
from tests.family_checks import matrix_matches_one_process, pipeline_matches_whole_model
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_reference import (
    Batch,
)

VOCAB = 96
HF_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "initializer_range": 0.1,  # decisive routing: near-ties between experts would make top-k fragile
    "rms_norm_eps": 1e-5,
}
CASES: dict[str, dict[str, Any]] = {
    # low-rank queries, interleaved RoPE, 4 groups of 2 experts (a token's experts from its best 2 groups),
    # one shared expert, the first layer dense, DeepSeek-V3's weight scaling
    "v3": {
        "q_lora_rank": 24,
        "rope_interleave": True,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    },
    # full-rank queries (V2-Lite style), half-layout RoPE, no groups, two shared experts, all layers MoE,
    # unnormalized weights, biases on the attention projections
    "lite": {
        "q_lora_rank": None,
        "rope_interleave": False,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 2,
        "first_k_dense_replace": 0,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "attention_bias": True,
    },
    # V3's long-context RoPE: YaRN with mscale / mscale_all_dim (which also scales the softmax)
    "v3_yarn": {
        "q_lora_rank": 24,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "max_position_embeddings": 64,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
}


def _hf_model(**extra: Any) -> transformers.DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_COMMON, **extra))
    with torch.no_grad():  # random norms, biases and expert biases make the parity stricter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    return model.eval()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = _hf_model(**CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, dm.from_pretrained(path), path


def _ids(batch: int = 2, seq: int = 13) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_the_router_is_transformers(pair) -> None:
    """Sigmoid scores, the bias for selection only, group-limited top-k, renormalization, scaling."""
    hf, ours, _ = pair
    layer = hf.config.first_k_dense_replace
    hf_gate = hf.model.layers[layer].mlp.gate
    our_gate = ours.model.decoder_layers()[layer].mlp.gate
    assert isinstance(our_gate, TopKRouter)
    torch.testing.assert_close(our_gate.expert_bias, hf_gate.e_score_correction_bias, rtol=0, atol=0)
    x = torch.randn(64, HF_COMMON["hidden_size"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, want_weights, want_ids = hf_gate(x)
        routing = our_gate(x)
    order_hf, order_ours = want_ids.sort(dim=-1), routing.topk_ids.sort(dim=-1)
    assert torch.equal(order_ours.values, order_hf.values)
    torch.testing.assert_close(
        routing.topk_weights.gather(1, order_ours.indices), want_weights.gather(1, order_hf.indices)
    )


def test_from_pretrained_builds_deepseek_v3(pair) -> None:
    hf, ours, _ = pair
    assert type(ours) is DeepSeekV3ForCausalLM
    c = ours.config
    assert (c.q_lora_rank, c.num_expert_groups, c.first_k_dense) == (
        hf.config.q_lora_rank,
        hf.config.n_group,
        hf.config.first_k_dense_replace,
    )
    assert c.expert_bias  # DeepSeek-V3 routes with the bias


def test_logits_match(pair) -> None:
    hf, ours, _ = pair
    ids = _ids()
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(input_ids=ids)["logits"]
    assert got.shape == expected.shape
    assert _rel_err(got, expected) <= 1e-5


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def test_loss_and_every_gradient_match(pair) -> None:
    hf, ours, _ = pair
    ids = _ids()
    labels_hf = ids.clone()
    labels_hf[0, 5] = -100
    hf.zero_grad()
    ours.zero_grad()
    hf_loss = hf(ids, labels=labels_hf).loss
    hf_loss.backward()
    labels = _shifted(labels_hf)
    loss = ours(input_ids=ids, labels=labels)["loss"].sum() / (labels != -100).sum()
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())

    grads = {name: p.grad for name, p in ours.named_parameters()}
    mapper = d9d_to_hf_mapper(ours.config, expert_layout="fused")  # transformers v5's in-memory layout
    got: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        if group.inputs <= grads.keys():  # the expert bias is a buffer: no gradient
            got |= apply_group(mapper, group, {k: grads[k] for k in group.inputs})
    expected = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert _rel_err(got[name], grad) <= 1e-5, name


def test_an_export_keeps_the_bias_and_loads_in_transformers(tmp_path: Path) -> None:
    config = DeepSeekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=8,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_expert_groups=2,
        topk_groups=1,
        first_k_dense=1,
        routed_scaling_factor=2.0,
        initializer_range=0.1,
    )
    torch.manual_seed(3)
    model = DeepSeekV3ForCausalLM(config)
    model.reset_parameters()
    gate = model.model.decoder_layers()[1].mlp.gate
    with torch.no_grad():
        gate.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))  # as after some balancing steps
    dest = dm.save_pretrained(model, tmp_path / "export")
    assert json.loads((dest / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    tensors = load_file(dest / "model.safetensors")
    torch.testing.assert_close(tensors["model.layers.1.mlp.gate.e_score_correction_bias"], gate.expert_bias)
    hf = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
    assert type(hf) is transformers.DeepseekV3ForCausalLM
    ids = _ids(2, 9)
    with torch.no_grad():
        assert _rel_err(model(input_ids=ids)["logits"], hf(ids).logits) <= 1e-5
    again = dm.from_pretrained(dest)
    assert again.config == config
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_config_conversion_refuses_what_it_cannot_reproduce() -> None:
    hf = transformers.DeepseekV3Config(**HF_COMMON, q_lora_rank=24).to_dict()
    with pytest.raises(ValueError, match="num_key_value_heads=2 differs"):
        config_from_hf({**hf, "num_key_value_heads": 2})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        config_from_hf({**hf, "hidden_act": "gelu"})
    config = config_from_hf(hf)
    assert config_from_hf(config_to_hf(config)) == config


# -- the engine's provider ------------------------------------------------------------------------------

ARCH: dict[str, Any] = {
    "vocab_size": 259,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 8,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_expert_groups": 2,
    "topk_groups": 1,
    "first_k_dense": 1,
}


def _job(tmp: Path, architecture: dict[str, Any], mesh: dict[str, int]) -> dict[str, Any]:
    corpus = tmp / "corpus.txt"
    corpus.write_text("a few words\nand some more\n")
    return {
        "run": {"name": "deepseek", "dir": str(tmp / "run")},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": 5},
        "mesh": mesh,
        "model": {"provider": "deepseek_v3", "options": {"architecture": architecture}},
        "data": {"provider": "text", "options": {"dataset": {"paths": [str(corpus)], "max_length": 16}}},
    }


def test_the_engine_builds_checks_and_estimates_deepseek_v3(tmp_path: Path) -> None:
    config = parse_config(_job(tmp_path, ARCH, {"tensor_parallel": 2, "expert_parallel": 2}))
    preflight(config)
    report = dry_run(config)
    model = DeepSeekV3ForCausalLM(DeepSeekV3Config(**ARCH))
    assert report.parameters.total == sum(p.numel() for p in model.parameters())
    (memory,) = report.memory
    # experts split over ep, every other matrix over tp, vectors (norms) whole: an independent count
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    router = sum(p.numel() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    rest = sum(p.numel() for p in model.parameters()) - experts - vectors - router
    assert memory.parameters == 4 * (experts // 2 + rest // 2 + vectors + router)
    assert memory.activations is not None
    bad = parse_config(
        _job(
            tmp_path,
            {**ARCH, "num_experts": 6, "num_expert_groups": 3},
            {"data_parallel_shard": 4, "expert_parallel": 4},
        )
    )
    with pytest.raises(ConfigError, match=r"num_experts=6 is not divisible by mesh\.expert_parallel=4"):
        preflight(bad)


# -- parallel matrix on gloo ----------------------------------------------------------------------------

SEQ, MAX_NORM = 8, 0.5


def _model(stage: PipelineStageInfo | None = None, layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = DeepSeekV3Config(
        vocab_size=43,
        vocab_splits={"regular": 40, "special": 3},
        hidden_size=16,
        num_layers=layers,
        num_attention_heads=4,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        num_expert_groups=2,
        topk_groups=1,
        first_k_dense=1,
        routed_scaling_factor=2.0,
        attention_backend="torch",
        grouped_mm="eager",
        loss_chunk_size=5,
    )
    return DeepSeekV3ForCausalLM(config, stage)


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, positions = batch.inputs.unbind(1)
    return model(input_ids=ids, position_ids=positions, labels=batch.targets)["loss"].sum()


def _batches(steps: int, size: int) -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 43, (size, SEQ + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
        positions = torch.arange(SEQ).expand(size, SEQ)
        out.append(Batch(torch.stack((ids[:, :-1], positions), dim=1), labels, (labels != -100).float()))
    return out


MATRIX = [  # (mesh, sequence parallel, built on meta and materialized after parallelization)
    ({"data_parallel_shard": 2, "expert_parallel": 2}, False, True),
    ({"data_parallel_replicate": 2, "expert_parallel": 2}, False, False),
    ({"tensor_parallel": 2}, False, False),
    ({"tensor_parallel": 2}, True, True),
    ({"context_parallel_shard": 2, "expert_parallel": 2}, False, False),
]


def _matrix(env: RankEnv) -> None:
    def parallelize(model: nn.Module, ctx: DistributedContext, sp: bool) -> None:
        plan = ParallelPlanConfig(sequence_parallel=sp, expert_backend=AllToAllBackendConfig())
        parallelize_deepseek_v3(model, ctx, plan)

    matrix_matches_one_process(_model, parallelize, _batches(3, 4), _loss, MATRIX, "deepseek_v3", MAX_NORM)


@pytest.mark.distributed
def test_two_rank_matrix_matches_one_process() -> None:
    run_distributed(_matrix, 2, timeout=300)


FOUR_RANK_MATRIX = [
    # examples/deepseek_v3_pretrain/tiny.yaml's layout
    ({"data_parallel_replicate": 2, "data_parallel_shard": 2, "expert_parallel": 2}, False, True),
    # latent attention split by heads beside token-split MoE layers whose experts are split over ep
    ({"data_parallel_replicate": 2, "tensor_parallel": 2, "expert_parallel": 2}, True, False),
    # the latent attention's replicated down projections and norms beside TP DTensors, under FSDP
    ({"data_parallel_shard": 2, "tensor_parallel": 2}, True, True),
    # the shared rotary key's gradient summed over tp, its keys gathered over cp
    ({"context_parallel_shard": 2, "tensor_parallel": 2}, True, False),
]


def _four_rank_matrix(env: RankEnv) -> None:
    def parallelize(model: nn.Module, ctx: DistributedContext, sp: bool) -> None:
        plan = ParallelPlanConfig(sequence_parallel=sp, expert_backend=AllToAllBackendConfig())
        parallelize_deepseek_v3(model, ctx, plan)

    matrix_matches_one_process(
        _model, parallelize, _batches(3, 8), _loss, FOUR_RANK_MATRIX, "deepseek_v3", MAX_NORM
    )


@pytest.mark.distributed
def test_four_rank_matrix_with_the_examples_layout_matches_one_process() -> None:
    run_distributed(_four_rank_matrix, 4, timeout=400)


@pytest.mark.distributed
def test_pipeline_of_two_stages_matches_the_whole_model() -> None:
    run_distributed(
        pipeline_matches_whole_model, 2, "tests.test_models_deepseek_v3:_model", 43, SEQ, timeout=200
    )


# -- the example config ---------------------------------------------------------------------------------

REPO = Path(__file__).parent.parent
EXAMPLE = REPO / "examples" / "deepseek_v3_pretrain" / "tiny.yaml"


def test_the_example_config_validates_passes_preflight_and_trains_a_step(tmp_path: Path) -> None:
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    data.pop("cluster")  # the cluster layer's section; the engine config is the rest
    data["run"]["dir"] = str(tmp_path / "run")
    dataset = data["data"]["options"]["dataset"]
    dataset["paths"] = [str(REPO / p) for p in dataset["paths"]]
    config = parse_config(data)
    assert config.model.provider == "deepseek_v3" and config.mesh.world_size == 4
    preflight(config)
    (memory, *_) = dry_run(config).memory
    assert memory.activations is not None
    # the example's model learns: 10 AdamW steps on one of its batches lower the loss
    from d9d.engine.builtin.models import builtin_provider

    provider_class = builtin_provider("deepseek_v3")
    provider = provider_class(provider_class.Config.model_validate(data["model"]["options"]))
    torch.manual_seed(0)
    model = provider.build_stage(PipelineStageInfo())
    model.reset_parameters()
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"].mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
