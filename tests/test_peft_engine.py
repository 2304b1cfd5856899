"""The `peft` model provider end to end through the engine: a tiny Qwen3 from a Hugging Face source
checkpoint made here, LoRA trained for a few steps on one gloo rank, merged weights and a `peft` adapter
exported; the loss drops and only the adapters moved."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from d9d.core import DeviceMeshParameters
from d9d.engine.builtin.peft import PeftModelProvider
from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import RankRuntime
from d9d.pipeline.api import PipelineStageInfo
from tests.engine_fixtures import VOCAB
from tests.harness import RankEnv, run_distributed

PROVIDER = "d9d.engine.builtin.peft:PeftModelProvider"
TARGETS = r".*\.(q_proj|v_proj|up_proj|down_proj)"
RANK, ALPHA = 8, 32.0


def _source(path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        initializer_range=0.3,  # a frozen head at the usual 0.02 could not express confident predictions
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def _config(run_dir: Path, source: Path, method: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": {"name": "lora", "dir": str(run_dir)},
        "batching": {"global_batch_size": 8, "microbatch_size": 4},
        "trainer": {"total_steps": 20},
        "logging": {"progress_bar": "off", "period": 4},
        "checkpointing": {"export_hf_dir": str(run_dir / "export")},
        "model": {
            "provider": PROVIDER,
            "options": {
                "base": {"provider": "qwen3", "options": {"source_checkpoint": str(source)}},
                "method": method,
                "export_adapters": True,
            },
        },
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "causal_lm"},
        "optimizer": {"provider": "adamw", "options": {"lr": 2e-2, "weight_decay": 0.0}},
    }


def _train(
    env: RankEnv, source: Path, mesh: dict[str, int], sections: dict[str, Any] | None = None, name: str = ""
) -> None:
    """`sections` replace whole sections of the job; results go to `<name or dp<world size>>.pt`."""
    name = name or f"dp{env.world_size}"
    method = {"kind": "lora", "target_modules": TARGETS, "rank": RANK, "alpha": ALPHA}
    _run(env, name, {**_config(env.tmp_dir / name, source, method), "mesh": mesh, **(sections or {})})


def _run(env: RankEnv, name: str, job: dict[str, Any]) -> None:
    """Train `job` on this rank; rank 0 saves the losses to `<name>.pt`."""
    config = parse_config(job)
    runtime = RankRuntime(
        rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
    )
    result = run_rank(config, runtime, LocalRunReporter(config.checkpoint_dir, 1))
    if env.rank == 0:
        torch.save({"losses": list(result.losses)}, env.tmp_dir / f"{name}.pt")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _source(tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def one_rank(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("engine")
    run_distributed(_train, 1, source, {}, tmp_dir=tmp, timeout=240)
    return tmp


@pytest.mark.distributed
def test_lora_through_the_engine(source: Path, one_rank: Path) -> None:
    losses = torch.tensor(torch.load(one_rank / "dp1.pt")["losses"])
    assert len(losses) == 20
    assert losses[-3:].mean() < 0.7 * losses[:3].mean(), losses

    export = one_rank / "dp1" / "export"
    base = load_file(source / "model.safetensors")
    merged = load_file(export / "model.safetensors")
    adapter = load_file(export / "adapter" / "adapter_model.safetensors")
    assert merged.keys() == base.keys()
    targets = {
        k for k in base if any(f".{p}.weight" in k for p in ("q_proj", "v_proj", "up_proj", "down_proj"))
    }
    assert len(targets) == 4 * 2
    for key in sorted(base.keys() - targets):  # untargeted weights: bit for bit the source checkpoint
        assert torch.equal(merged[key], base[key]), key
    for key in sorted(targets):  # targeted weights: the source weight plus exactly the exported update
        module = key.removesuffix(".weight")
        a = adapter[f"base_model.model.{module}.lora_A.weight"]
        b = adapter[f"base_model.model.{module}.lora_B.weight"]
        assert b.abs().max() > 0, key
        torch.testing.assert_close(merged[key], base[key] + (ALPHA / RANK) * b @ a, rtol=0, atol=1e-6)

    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    with torch.no_grad():
        with_adapter = peft.PeftModel.from_pretrained(hf_base, export / "adapter").eval()
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, hf_merged(input_ids=ids).logits)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "mesh", [{"data_parallel_replicate": 2}, {"data_parallel_shard": 2}], ids=["dp2", "fsdp2"]
)
def test_lora_under_data_parallelism_matches_one_rank(
    source: Path, one_rank: Path, tmp_path: Path, mesh: dict[str, int]
) -> None:
    """Replicated or FSDP-sharded (DTensor) base weights and adapters: same losses, same exports."""
    run_distributed(_train, 2, source, mesh, tmp_dir=tmp_path, timeout=240)
    torch.testing.assert_close(
        torch.tensor(torch.load(tmp_path / "dp2.pt")["losses"]),
        torch.tensor(torch.load(one_rank / "dp1.pt")["losses"]),
        rtol=1e-5,
        atol=1e-5,
    )
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        two, one = (
            load_file(tmp_path / "dp2" / "export" / name),
            load_file(one_rank / "dp1" / "export" / name),
        )
        assert two.keys() == one.keys()
        for key in one:
            torch.testing.assert_close(two[key], one[key], rtol=1e-4, atol=1e-5)


LAYOUTS: dict[str, tuple[int, dict[str, int], dict[str, Any]]] = {  # name: (ranks, mesh, sections)
    "pp2-1f1b": (2, {"pipeline_parallel": 2}, {"pipelining": {"kind": "1f1b"}}),
    "hsdp2x2": (
        4,
        {"data_parallel_replicate": 2, "data_parallel_shard": 2},
        {"batching": {"global_batch_size": 8, "microbatch_size": 2}},
    ),
    # one rank: adapted projections inside compiled blocks, recomputed by full activation checkpointing
    "compiled-full-ac": (
        1,
        {},
        {"compile": {"enabled": True, "backend": "aot_eager"}, "activation_checkpointing": {"mode": "full"}},
    ),
}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_under_other_layouts_matches_one_rank(
    source: Path, one_rank: Path, tmp_path: Path, layout: str
) -> None:
    """Adapters in pipeline stages, under HSDP, and compiled with activation checkpointing: the losses of
    the one-rank run (the loss does not depend on how the batch is split into microbatches). A pipeline
    stage starts from the same adapters as the whole model (`adapter_seed` and the module's name; from the
    stage's own RNG stream the losses parted from step 2)."""
    ranks, mesh, sections = LAYOUTS[layout]
    run_distributed(_train, ranks, source, mesh, sections, layout, tmp_dir=tmp_path, timeout=300)
    torch.testing.assert_close(
        torch.tensor(torch.load(tmp_path / f"{layout}.pt")["losses"]),
        torch.tensor(torch.load(one_rank / "dp1.pt")["losses"]),
        rtol=1e-5,
        atol=1e-5,
    )


def _train_moe(env: RankEnv, source: Path, mesh: dict[str, int], name: str) -> None:
    """LoRA on a Qwen3-MoE's experts (gate and down) and query projections; 10 steps, losses saved."""
    method = {"kind": "lora", "target_modules": r".*\.experts\.(gate_proj|down_proj)|.*\.q_proj", "rank": 4}
    raw = _config(env.tmp_dir / name, source, method)
    raw["model"]["options"]["base"]["provider"] = "qwen3_moe"
    raw["model"]["options"]["export_adapters"] = False  # the peft layout has no expert LoRA
    sections = {
        "mesh": mesh,
        "trainer": {"total_steps": 10},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "checkpointing": {"save_at_end": False},
    }
    _run(env, name, {**raw, **sections})


@pytest.mark.distributed
def test_expert_lora_under_expert_and_data_parallelism_matches_one_rank(tmp_path: Path) -> None:
    """Expert LoRA factors sharded over ep like the experts, summed over the expert replicas by the
    synchronizer (HSDP 2 × 2 × EP 2: two replicas of each expert shard), FSDP-sharded elsewhere: the
    one-rank losses (the checkpoint's balancing loss weighted 0.001 included)."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    make_hf_qwen3_moe(tmp_path / "hf-moe", num_layers=2)
    source = tmp_path / "hf-moe"
    run_distributed(_train_moe, 1, source, {}, "one", tmp_dir=tmp_path, timeout=300)
    fsdp_ep = {"data_parallel_shard": 2, "expert_parallel": 2}
    run_distributed(_train_moe, 2, source, fsdp_ep, "fsdp2-ep2", tmp_dir=tmp_path, timeout=300)
    hsdp_ep = {"data_parallel_replicate": 2, "data_parallel_shard": 2, "expert_parallel": 2}
    run_distributed(_train_moe, 4, source, hsdp_ep, "hsdp2x2-ep2", tmp_dir=tmp_path, timeout=300)
    want = torch.tensor(torch.load(tmp_path / "one.pt")["losses"])
    assert len(want) == 10 and want[-3:].mean() < want[:3].mean(), want
    for name in ("fsdp2-ep2", "hsdp2x2-ep2"):
        got = torch.tensor(torch.load(tmp_path / f"{name}.pt")["losses"])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


def test_tensor_parallelism_of_adapted_layers_is_refused(source: Path) -> None:
    method = {"kind": "lora", "target_modules": TARGETS}
    options = _config(Path("unused"), source, method)["model"]["options"]
    provider = PeftModelProvider(PeftModelProvider.Config.model_validate(options))
    with torch.device("meta"):
        module = provider.build_stage(PipelineStageInfo())
    ctx = SimpleNamespace(params=DeviceMeshParameters(tensor_parallel=2))
    with pytest.raises(
        ValueError, match=r"mesh\.tensor_parallel=2: LoRA-adapted layers cannot be tensor-parallel"
    ):
        provider.parallelize(module, ctx)  # type: ignore[arg-type]
    # and at config time, before any process starts: LoRA, also inside a stack; full tuning alone is fine
    stacked = {"kind": "stack", "methods": [{"kind": "full_tune", "target_modules": ".*norm"}, method]}
    for lora in (method, stacked):
        job = {**_config(Path("unused"), source, lora), "mesh": {"tensor_parallel": 2}}
        job["model"]["provider"] = "peft"  # the catalogue's name (a plug-in path is refused when built)
        with pytest.raises(
            ConfigError, match=r"mesh\.tensor_parallel = 2 with model\.options\.method \(LoRA\)"
        ):
            parse_config(job)
    full = {"kind": "full_tune", "target_modules": ".*norm"}
    job = {**_config(Path("unused"), source, full), "mesh": {"tensor_parallel": 2}}
    job["model"]["provider"] = "peft"
    job["model"]["options"]["export_adapters"] = False  # a peft adapter needs LoRA (refused otherwise)
    parse_config(job)


def test_provider_options_are_checked_at_config_time(source: Path, tmp_path: Path) -> None:
    lora = {"kind": "lora", "target_modules": TARGETS}
    config = _config(tmp_path, source, lora)
    config["model"]["options"]["base"]["options"]["dtype"] = "float16"
    with pytest.raises(ConfigError, match=r"model\.options: .*base\.options\.dtype: Input should be"):
        parse_config(config)
    config = _config(tmp_path, source, {"kind": "lora", "target_modules": "("})
    # The path as written: the method's union tag (`lora`) is not part of it.
    with pytest.raises(ConfigError, match=r"model\.options\.method\.target_modules: .*regular expression"):
        parse_config(config)
    config = _config(tmp_path, source, lora)
    config["model"]["options"]["base"] = {"provider": PROVIDER, "options": {}}
    with pytest.raises(ConfigError, match="cannot wrap another"):
        parse_config(config)
