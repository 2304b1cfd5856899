"""Llama 3: parity with transformers' `LlamaForCausalLM` (float32, tiny random models: logits, loss and every
gradient within 1e-5), Hugging Face import and export, the engine's `llama3` provider, and the gloo parallel
matrix (FSDP, HSDP, TP, TP + SP, CP, pipeline 1F1B) against one process."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import d9d.models as dm
from d9d.engine.config import parse_config
from d9d.engine.dry_run import dry_run
from d9d.engine.errors import ConfigError
from d9d.engine.preflight import preflight
from d9d.models.hf import config_from_hf, config_to_hf, d9d_to_hf_mapper
from d9d.models.llama3 import (
    Llama3Config,
    Llama3ForCausalLM,
    Llama3RopeScaling,
    llama3_inv_freq,
    parallelize_llama3,
)
from d9d.parallel.plans import ParallelPlanConfig
from d9d.pipeline.api import PipelineStageInfo
from d9d.state import apply_group
from tests.family_checks import matrix_matches_one_process, pipeline_matches_whole_model
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_reference import Batch

VOCAB = 96
HF_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-5,
}
# Llama 3.1's scaling with a short pretraining context, so the head's 8 frequencies fall in all three bands
# (kept, blended, divided by `factor`).
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES: dict[str, dict[str, Any]] = {
    "llama3.1": {"rope_parameters": LLAMA31_ROPE},
    "llama3.2_tied": {"rope_parameters": LLAMA31_ROPE, "tie_word_embeddings": True},
    "llama3.0_bias": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "attention_bias": True,
    },
}


def _hf_model(**extra: Any) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_COMMON, **extra))
    with torch.no_grad():  # HF initializes norms to one and biases to zero; random ones make parity stricter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
    return model.eval()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    hf = _hf_model(**CASES[request.param])
    path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    hf.save_pretrained(path)
    return hf, dm.from_pretrained(path), path


def _ids(batch: int = 2, seq: int = 13) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def test_llama3_frequencies_are_transformers(pair) -> None:
    hf, ours, _ = pair
    want, factor = ROPE_INIT_FUNCTIONS.get(hf.config.rope_parameters["rope_type"], _default_rope)(hf.config)
    config = ours.config
    if isinstance(config.rope_scaling, Llama3RopeScaling):
        got = llama3_inv_freq(config.rope_scaling, config.head_dim, config.rope_theta)
    else:
        got = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
    torch.testing.assert_close(got, want.float(), rtol=1e-7, atol=0)
    assert factor == 1.0


def _default_rope(config: transformers.LlamaConfig) -> tuple[torch.Tensor, float]:
    return transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(
        config
    )


def test_from_pretrained_builds_llama3(pair) -> None:
    hf, ours, _ = pair
    assert type(ours) is Llama3ForCausalLM
    assert ours.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert ours.config.attention_bias == hf.config.attention_bias
    scaled = hf.config.rope_parameters["rope_type"] == "llama3"
    assert isinstance(ours.config.rope_scaling, Llama3RopeScaling) == scaled


def test_logits_match(pair) -> None:
    hf, ours, _ = pair
    ids = _ids()
    # positions beyond the scaling's pretraining context (64), where its bands differ most
    positions = torch.arange(13).expand(2, 13) * 9
    with torch.no_grad():
        expected = hf(ids, position_ids=positions).logits
        got = ours(input_ids=ids, position_ids=positions)["logits"]
    assert got.shape == expected.shape
    assert _rel_err(got, expected) <= 1e-5


def _shifted(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def test_loss_and_every_gradient_match(pair) -> None:
    hf, ours, _ = pair
    ids = _ids()
    labels_hf = ids.clone()
    labels_hf[1, 3] = -100
    hf.zero_grad()
    ours.zero_grad()
    hf_loss = hf(ids, labels=labels_hf).loss
    hf_loss.backward()
    labels = _shifted(labels_hf)
    per_token = ours(input_ids=ids, labels=labels)["loss"]
    loss = per_token.sum() / (labels != -100).sum()
    loss.backward()
    assert abs(loss.item() - hf_loss.item()) <= 1e-5 * abs(hf_loss.item())

    grads = {k: ours.get_parameter(k).grad for k in ours.state_dict()}
    mapper = d9d_to_hf_mapper(ours.config)
    got: dict[str, torch.Tensor] = {}
    for group in mapper.groups():
        got |= apply_group(mapper, group, {k: grads[k] for k in group.inputs})
    expected = {name: p.grad for name, p in hf.named_parameters() if p.grad is not None}
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert _rel_err(got[name], grad) <= 1e-5, name


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_export_loads_in_transformers_with_equal_logits(tmp_path: Path, tied: bool) -> None:
    """A d9d-initialized Llama 3.1 (vocabulary split in two) saved in Hugging Face format: transformers picks
    `LlamaForCausalLM` and computes the same logits."""
    config = Llama3Config(
        vocab_size=VOCAB,
        vocab_splits={"regular": 90, "special": 6},
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=48,
        rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position_embeddings=32),
        tie_word_embeddings=tied,
        initializer_range=0.1,
    )
    torch.manual_seed(3)
    model = Llama3ForCausalLM(config)
    model.reset_parameters()
    dest = dm.save_pretrained(model, tmp_path / "export")
    written = json.loads((dest / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["head_dim"] == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
    assert type(hf) is transformers.LlamaForCausalLM
    ids = _ids(2, 11)
    with torch.no_grad():
        assert _rel_err(model(input_ids=ids)["logits"], hf(ids).logits) <= 1e-5
    # and back: the same config, the same weights
    again = dm.from_pretrained(dest, config_overrides={"vocab_splits": {"regular": 90, "special": 6}})
    assert again.config == config
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_config_conversion_refuses_what_it_cannot_reproduce() -> None:
    hf = transformers.LlamaConfig(**HF_COMMON).to_dict()
    for field, value, message in (
        ("mlp_bias", True, "mlp_bias"),
        ("pretraining_tp", 2, "pretraining_tp=2"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
    ):
        with pytest.raises(ValueError, match=message):
            config_from_hf({**hf, field: value})
    config = config_from_hf({**hf, "rope_parameters": LLAMA31_ROPE})
    assert config_from_hf(config_to_hf(config)) == config
    without_head_dim = {k: v for k, v in hf.items() if k != "head_dim"}
    assert config_from_hf(without_head_dim).head_dim == HF_COMMON["hidden_size"] // 4


# -- the engine's provider ------------------------------------------------------------------------------

ARCH = {
    "vocab_size": 259,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "rope_scaling": {"kind": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
}


def _job(tmp: Path, architecture: dict[str, Any], mesh: dict[str, int]) -> dict[str, Any]:
    corpus = tmp / "corpus.txt"
    corpus.write_text("a few words\nand some more\n")
    return {
        "run": {"name": "llama", "dir": str(tmp / "run")},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": 5},
        "mesh": mesh,
        "model": {"provider": "llama3", "options": {"architecture": architecture}},
        "data": {"provider": "text", "options": {"dataset": {"paths": [str(corpus)], "max_length": 16}}},
    }


def test_the_engine_builds_checks_and_estimates_llama3(tmp_path: Path) -> None:
    config = parse_config(_job(tmp_path, ARCH, {"tensor_parallel": 2, "data_parallel_shard": 2}))
    preflight(config)
    report = dry_run(config)
    total = sum(p.numel() for p in Llama3ForCausalLM(Llama3Config(**ARCH)).parameters())  # type: ignore[arg-type]
    assert report.parameters.total == total
    (memory,) = report.memory
    # 2 layers × 2 norms + the final norm stay whole, matrices split over tp: FSDP keeps a model this small
    # gathered from forward to backward (`auto` under `keep_gathered_gib`)
    norms = 2 * 2 * 32 + 32
    assert memory.parameters == 4 * ((total - norms) // 2 + norms)
    assert memory.activations is not None
    with pytest.raises(
        ConfigError, match=r"model\.options\.architecture\.num_attention_heads: Field required"
    ):
        parse_config(_job(tmp_path, {k: v for k, v in ARCH.items() if k != "num_attention_heads"}, {}))
    bad = parse_config(_job(tmp_path, {**ARCH, "intermediate_size": 50}, {"tensor_parallel": 4}))
    with pytest.raises(
        ConfigError, match=r"intermediate_size=50 is not divisible by mesh\.tensor_parallel=4"
    ):
        preflight(bad)


# -- parallel matrix on gloo ----------------------------------------------------------------------------

SEQ, MAX_NORM = 8, 0.5


def _model(stage: PipelineStageInfo | None = None, layers: int = 2, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = Llama3Config(
        tie_word_embeddings=tied,
        vocab_size=43,
        vocab_splits={"regular": 40, "special": 3},  # the special split does not divide over tp = 2
        hidden_size=16,
        num_layers=layers,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=24,
        rope_scaling=Llama3RopeScaling(factor=4.0, original_max_position_embeddings=16),
        attention_backend="torch",
        loss_chunk_size=5,
    )
    return Llama3ForCausalLM(config, stage)


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, positions = batch.inputs.unbind(1)
    return model(input_ids=ids, position_ids=positions, labels=batch.targets)["loss"].sum()


def _batches(steps: int, size: int) -> list[Batch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 43, (size, SEQ + 1), generator=g)
        labels = ids[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.2] = -100  # uneven token counts per rank
        positions = torch.arange(SEQ).expand(size, SEQ) * 5  # past the scaling's 16-token context
        out.append(Batch(torch.stack((ids[:, :-1], positions), dim=1), labels, (labels != -100).float()))
    return out


MATRIX = [  # (mesh, sequence parallel, built on meta and materialized after parallelization)
    ({"data_parallel_shard": 2}, False, True),
    ({"data_parallel_replicate": 2}, False, False),
    ({"tensor_parallel": 2}, False, False),
    ({"tensor_parallel": 2}, True, True),
    ({"context_parallel_shard": 2}, False, False),
]


def _matrix(env: RankEnv) -> None:
    matrix_matches_one_process(
        _model,
        lambda model, ctx, sp: parallelize_llama3(model, ctx, ParallelPlanConfig(sequence_parallel=sp)),
        _batches(3, 4),
        _loss,
        MATRIX,
        "llama3",
        MAX_NORM,
    )


@pytest.mark.distributed
def test_two_rank_matrix_matches_one_process() -> None:
    run_distributed(_matrix, 2, timeout=300)


FOUR_RANK_MATRIX = [
    ({"data_parallel_shard": 2, "tensor_parallel": 2}, True, True),  # examples/llama3_pretrain/tiny.yaml's
    ({"data_parallel_replicate": 2, "data_parallel_shard": 2}, False, False),
]


def _four_rank_matrix(env: RankEnv) -> None:
    for tied in (False, True):  # Llama 3.2 ties the head to the embedding (one parameter, two uses)
        matrix_matches_one_process(
            functools.partial(_model, tied=tied),
            lambda model, ctx, sp: parallelize_llama3(model, ctx, ParallelPlanConfig(sequence_parallel=sp)),
            _batches(3, 8),
            _loss,
            FOUR_RANK_MATRIX,
            f"llama3 tied={tied}",
            MAX_NORM,
        )


@pytest.mark.distributed
def test_four_rank_matrix_with_the_examples_layout_matches_one_process() -> None:
    run_distributed(_four_rank_matrix, 4, timeout=300)


@pytest.mark.distributed
def test_pipeline_of_two_stages_matches_the_whole_model() -> None:
    run_distributed(pipeline_matches_whole_model, 2, "tests.test_models_llama3:_model", 43, SEQ, timeout=200)


# -- the example config ---------------------------------------------------------------------------------

REPO = Path(__file__).parent.parent
EXAMPLE = REPO / "examples" / "llama3_pretrain" / "tiny.yaml"


def _example(run_dir: Path, **overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    data.pop("cluster")  # the cluster layer's section; the engine config is the rest
    data["run"]["dir"] = str(run_dir)
    dataset = data["data"]["options"]["dataset"]
    dataset["paths"] = [str(REPO / p) for p in dataset["paths"]]
    return data | overrides


def test_the_example_config_validates_and_passes_preflight(tmp_path: Path) -> None:
    config = parse_config(_example(tmp_path))
    assert config.model.provider == "llama3" and config.mesh.world_size == 4
    preflight(config)
    report = dry_run(config)
    (memory,) = report.memory
    assert memory.ranks == (0, 1, 2, 3) and memory.activations is not None


def _train_example(env: RankEnv) -> None:
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.launch import run_rank
    from d9d.engine.runtime import RankRuntime

    # one process (the example's 4-rank mesh is covered by the matrix above), 12 steps
    data = _example(env.tmp_dir / "run", mesh={}, trainer={"total_steps": 12})
    data["batching"] = {"global_batch_size": 8, "microbatch_size": 4}
    data["checkpointing"] = {"save_at_end": False}
    data["logging"] = {"progress_bar": "off", "period": 5}
    config = parse_config(data)
    reporter = LocalRunReporter(config.checkpoint_dir, 1, lambda _point: None)
    runtime = RankRuntime(rank=0, world_size=1, local_rank=0, run_dir=config.run_dir)
    result = run_rank(config, runtime, reporter)
    torch.save(list(result.losses), env.tmp_dir / "losses.pt")


@pytest.mark.distributed
def test_the_example_trains(tmp_path: Path) -> None:
    run_distributed(_train_example, 1, tmp_dir=tmp_path, timeout=300)
    losses = torch.tensor(torch.load(tmp_path / "losses.pt"))
    assert len(losses) == 12 and torch.isfinite(losses).all()
    assert losses[-3:].mean() < 0.8 * losses[:3].mean(), losses
