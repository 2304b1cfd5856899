"""PEFT targets under pipeline parallelism: a pattern may match modules of some stages only (`model\\.norm`
is on the last one; LoRA on layer 0 on the first), but must match on one stage of the whole model.

The pp 2 engine runs (1F1B; ZBV, where one rank holds no trainable parameter at all) are checked against
an independent one-process reference: the Hugging Face `transformers` model trained by a plain SGD loop
(LoRA as forward hooks with the engine's initial factors), same batches, same gradient clipping."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from pydantic import TypeAdapter
from safetensors.torch import load_file
from torch import nn

import d9d.models as dm
from d9d.engine.builtin.peft import PeftModelProvider
from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import RankRuntime
from d9d.models.hf import config_from_hf
from d9d.peft import LoRALinear, adapted_modules, build_peft_method, inject_and_freeze, reset_adapters
from d9d.peft.config import PeftConfig
from d9d.pipeline.api import PipelineStageInfo
from tests.engine_fixtures import make_hf_qwen3, sample_tokens
from tests.harness import RankEnv, run_distributed

LAYERS = 6  # ZBV's 4 stages of at least one layer each: [embed, 0], [1, 2], [3, 4], [5, norm, head]
STEPS, GLOBAL_BATCH, LR, RANK, ALPHA = 4, 8, 0.5, 4, 8.0
NORM = {"kind": "full_tune", "target_modules": r"model\.norm"}
LORA_LAYER_0 = {
    "kind": "lora",
    "target_modules": r"model\.layers\.0\.self_attn\.(q_proj|v_proj)",
    "rank": RANK,
    "alpha": ALPHA,
}
STACK = {"kind": "stack", "methods": [LORA_LAYER_0, NORM]}
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name: (method, pipelining)
    # the first stage trains nothing
    "pp2-1f1b-norm": (NORM, {"kind": "1f1b"}),
    # each pattern matches on one stage only
    "pp2-1f1b-stack": (STACK, {"kind": "1f1b"}),
    # rank 0 holds stages 0 (LoRA) and 3 (norm), rank 1 stages 1 and 2: nothing trainable on rank 1
    "pp2-zbv-stack": (STACK, {"kind": "zbv"}),
}


def _job(
    run_dir: Path, source: Path, method: dict[str, Any], pipelining: dict[str, Any], steps: int = STEPS
) -> dict[str, Any]:
    return {
        "run": {"name": "peft-pp", "dir": str(run_dir)},
        "mesh": {"pipeline_parallel": 2},
        "pipelining": pipelining,
        "batching": {"global_batch_size": GLOBAL_BATCH, "microbatch_size": 2},
        "trainer": {"total_steps": steps},
        "logging": {"progress_bar": "off", "period": 1},
        "checkpointing": {"export_hf_dir": str(run_dir / "export")},
        "model": {
            "provider": "peft",
            "options": {
                "base": {"provider": "qwen3", "options": {"source_checkpoint": str(source)}},
                "method": method,
                # the peft layout needs a LoRA adapter (a full_tune-only export is refused)
                "export_adapters": any(m["kind"] == "lora" for m in _methods(method)),
            },
        },
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "task": {"provider": "causal_lm"},
        "optimizer": {"provider": "sgd", "options": {"lr": LR}},
    }


def _train(env: RankEnv, source: Path, layout: str, steps: int = STEPS, out: str = "") -> None:
    """Train `layout` for (up to) `steps` steps in `<tmp>/<layout>`, resuming from its last checkpoint;
    rank 0 saves this run's losses to `<out or layout>.pt`."""
    method, pipelining = LAYOUTS[layout]
    config = parse_config(_job(env.tmp_dir / layout, source, method, pipelining, steps))
    runtime = RankRuntime(
        rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
    )
    result = run_rank(config, runtime, LocalRunReporter(config.checkpoint_dir, 1))
    if env.rank == 0:
        torch.save({"losses": list(result.losses)}, env.tmp_dir / f"{out or layout}.pt")


def _reference(
    source: Path, method: dict[str, Any]
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`transformers` on one process: only `model.norm.weight` (when targeted) and LoRA factors as forward
    hooks train, by SGD on the engine's global batches, the loss the token mean, clipped to norm 1. The
    factors start as the engine's: d9d's injection and `reset_adapters(model, adapter_seed=0)`. Returns the
    losses, and the tuned tensors before and after training."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").float()
    hf.requires_grad_(False)
    trained: dict[str, torch.Tensor] = {}
    with torch.device("meta"):
        d9d_model = dm.Qwen3ForCausalLM(config_from_hf(hf.config.to_dict()))
    inject_and_freeze(d9d_model, build_peft_method(_peft_config(method)))
    d9d_model.to_empty(device="cpu")
    reset_adapters(d9d_model, 0)
    for name, module in adapted_modules(d9d_model):
        assert isinstance(module, LoRALinear)
        a = trained[f"{name}.lora_A"] = module.lora_A.detach().clone().requires_grad_(True)
        b = trained[f"{name}.lora_B"] = module.lora_B.detach().clone().requires_grad_(True)
        hf.get_submodule(name).register_forward_hook(_lora_hook(a, b, module.scale))
    if any(m["kind"] == "full_tune" for m in _methods(method)):
        trained["model.norm.weight"] = hf.get_submodule("model.norm").weight.requires_grad_(True)
    start = {k: v.detach().clone() for k, v in trained.items()}
    params = list(trained.values())
    optimizer = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        chunk = torch.stack([sample_tokens(step * GLOBAL_BATCH + i) for i in range(GLOBAL_BATCH)])
        logits = hf(input_ids=chunk[:, :-1]).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, start, {k: v.detach().clone() for k, v in trained.items()}


def _lora_hook(a: torch.Tensor, b: torch.Tensor, scale: float) -> Any:
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        return out + scale * (args[0] @ a.T @ b.T)

    return hook


def _methods(method: dict[str, Any]) -> list[dict[str, Any]]:
    return method["methods"] if method["kind"] == "stack" else [method]


def _peft_config(method: dict[str, Any]) -> PeftConfig:
    adapter: TypeAdapter[PeftConfig] = TypeAdapter(PeftConfig)
    return adapter.validate_python(method)


def _exported(run: Path) -> dict[str, torch.Tensor]:
    """The tuned tensors of an engine run, by their d9d names: the norm from the merged export, the
    factors from the `peft` adapter."""
    merged = {k: v for f in (run / "export").glob("model*.safetensors") for k, v in load_file(f).items()}
    tensors = {"model.norm.weight": merged["model.norm.weight"]}
    adapter_file = run / "export" / "adapter" / "adapter_model.safetensors"
    adapter = load_file(adapter_file) if adapter_file.exists() else {}
    for key, value in adapter.items():
        for factor in ("lora_A", "lora_B"):
            if key.endswith(f".{factor}.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(f".{factor}.weight")
                tensors[f"{module}.{factor}"] = value
    return tensors


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("source")
    make_hf_qwen3(path, num_layers=LAYERS)
    return path


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_targets_on_some_stages_train_like_one_process(source: Path, tmp_path: Path, layout: str) -> None:
    method, _ = LAYOUTS[layout]
    run_distributed(_train, 2, source, layout, tmp_dir=tmp_path, timeout=300)
    want_losses, start, want = _reference(source, method)
    losses = torch.load(tmp_path / f"{layout}.pt")["losses"]
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-5)
    _check_tuned(tmp_path / layout, start, want)
    assert set(want) == {"model.norm.weight"} if method is NORM else len(want) == 5


def _check_tuned(run: Path, start: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The run's tuned tensors are the reference's, and training moved each (LoRA A from step 2 on)."""
    got = _exported(run)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        assert (tensor - start[name]).abs().max() > 1e-3, name


@pytest.mark.distributed
def test_stages_that_train_nothing_checkpoint_and_resume(source: Path, tmp_path: Path) -> None:
    """ZBV, rank 1's two stages train nothing: their optimizers hold no parameter and add nothing to the
    checkpoint. Stopped after 2 steps and resumed, the run ends as the reference does."""
    run_distributed(_train, 2, source, "pp2-zbv-stack", 2, "first", tmp_dir=tmp_path, timeout=300)
    run_distributed(_train, 2, source, "pp2-zbv-stack", STEPS, "resumed", tmp_dir=tmp_path, timeout=300)
    want_losses, start, want = _reference(source, STACK)
    first, resumed = (torch.tensor(torch.load(tmp_path / f"{n}.pt")["losses"]) for n in ("first", "resumed"))
    assert len(first) == 2 and len(resumed) == STEPS  # the resumed run reports the restored history too
    torch.testing.assert_close(first, torch.tensor(want_losses[:2]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(resumed, torch.tensor(want_losses), rtol=1e-5, atol=1e-5)
    _check_tuned(tmp_path / "pp2-zbv-stack", start, want)


def test_a_pattern_matching_no_stage_is_refused_at_config_time(source: Path, tmp_path: Path) -> None:
    """A typo is refused when the config is validated, before any process starts, naming its key."""
    typo = {
        "kind": "stack",
        "methods": [LORA_LAYER_0, {"kind": "full_tune", "target_modules": r"model\.nrom"}],
    }
    for pipelining in ({"kind": "1f1b"}, {"kind": "zbv"}):
        stages = 2 if pipelining["kind"] == "1f1b" else 4
        expected = (
            "full_tune model.options.method.methods.1.target_modules 'model\\\\.nrom' fully matches no "
            f"module with parameters in any of {stages} pipeline stages of the model; candidates: "
            "model.embed_tokens"
        )
        with pytest.raises(ConfigError, match=re.escape(expected)):
            parse_config(_job(tmp_path, source, typo, pipelining))
    lora_typo = {**LORA_LAYER_0, "target_modules": r"model\.layers\.9\.self_attn\.q_proj"}
    expected = (
        "lora model.options.method.target_modules 'model\\\\.layers\\\\.9\\\\.self_attn\\\\.q_proj' fully "
        "matches no nn.Linear module or grouped-expert projection in any of 2 pipeline stages of the model; "
        "candidates: model.layers.0.self_attn.q_proj"
    )
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_config(_job(tmp_path, source, lora_typo, {"kind": "1f1b"}))
    for good in (NORM, STACK):  # and a pattern on one stage only is accepted
        parse_config(_job(tmp_path, source, good, {"kind": "1f1b"}))


@pytest.mark.parametrize("num_stages", [1, 2])
def test_the_provider_refuses_a_pattern_matching_no_stage_on_every_stage(
    source: Path, num_stages: int
) -> None:
    """Where the config check cannot look (a plug-in base) the provider refuses it when it builds any
    stage: the same error on every rank, before any collective."""
    typo = {"kind": "full_tune", "target_modules": r"model\.nrom"}
    options = _job(Path("unused"), source, typo, {})["model"]["options"]
    where = f" in any of {num_stages} pipeline stages of the model" if num_stages > 1 else ""
    expected = (
        "full_tune model.options.method.target_modules 'model\\\\.nrom' fully matches no module with "
        f"parameters{where}; candidates: model.embed_tokens"
    )
    for stage in range(num_stages):
        provider = PeftModelProvider(PeftModelProvider.Config.model_validate(options))
        with (
            torch.device("meta"),
            pytest.raises(ValueError, match=re.escape(expected)),
        ):
            provider.build_stage(PipelineStageInfo(stage, num_stages))
    options = {**options, "method": NORM}
    provider = PeftModelProvider(PeftModelProvider.Config.model_validate(options))
    with torch.device("meta"):
        first, last = (provider.build_stage(PipelineStageInfo(s, 2)) for s in range(2))
    assert not any(p.requires_grad for p in first.parameters())
    assert [n for n, p in last.named_parameters() if p.requires_grad] == ["model.norm.weight"]
