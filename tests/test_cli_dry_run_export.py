"""`d9d train --dry-run`, `d9d export` and the help text of every CLI option.

The export test trains a tiny LoRA run from a Hugging Face source checkpoint (with tokenizer and generation
config) on two FSDP ranks, then exports its committed checkpoint in this process: the merged model loads
in `transformers` and reproduces the trained d9d model's logits; the adapter loads offline through
`peft.AutoPeftModelForCausalLM` (which finds the base by the name the adapter config gives) and does too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.distributed.tensor import DTensor

from d9d.cli.main import build_parser, main
from d9d.core.context import DistributedContext
from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import parse_config
from d9d.engine.dry_run import DryRunReport, dry_run
from d9d.engine.trainer import Trainer
from d9d.models.hf import build_causal_lm
from d9d.models.qwen3 import Qwen3Config
from d9d.models.qwen3_moe import Qwen3MoEConfig
from d9d.pipeline.partition import StageCosts, split_layers
from tests.engine_fixtures import VOCAB
from tests.harness import RankEnv, run_distributed

REPO = Path(__file__).parent.parent
RANK, ALPHA = 4, 8.0
TARGETS = r".*\.(q_proj|v_proj|down_proj)"
IDS = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4], [8, 6, 0, 13, 2, 9, 1, 30]])
SIDE = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

MOE_ARCH = {
    "vocab_size": 259,  # the byte tokenizer's ids: preflight checks the model covers them
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def _job(tmp: Path, **sections: Any) -> dict[str, Any]:
    corpus = tmp / "corpus.txt"
    corpus.write_text("a few words\nand some more\n")
    return {
        "run": {"name": "dry", "dir": str(tmp / "run")},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": 5},
        "model": {"provider": "qwen3_moe", "options": {"architecture": MOE_ARCH}},
        "data": {"provider": "text", "options": {"dataset": {"paths": [str(corpus)], "max_length": 16}}},
        **sections,
    }


# -- dry run ------------------------------------------------------------------------------------------


def test_dry_run_prints_config_layout_parameters_and_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mesh = {"pipeline_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2}
    job = _job(tmp_path, mesh=mesh, cluster={"num_workers": 4})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))

    assert main(["train", str(path), "--dry-run", "--cpu", "--set", "trainer.total_steps=7"]) == 0
    out = capsys.readouterr().out

    # The resolved config is YAML with the defaults filled in and the overrides applied.
    resolved = yaml.safe_load(out.split("# layout")[0])
    assert resolved["trainer"]["total_steps"] == 7
    assert resolved["optimizer"]["provider"] == "adamw"
    assert resolved["cluster"]["num_workers"] == 4 and resolved["cluster"]["resources"]["gpus"] == 0
    # pp is the outermost physical dim, then dp_shard; experts are sharded over the two dp_shard ranks.
    for rank in range(4):
        pp, shard = divmod(rank, 2)
        assert f"rank {rank}: pp={pp} dp_replicate=0 dp_shard={shard} cp=0 tp=0 ep={shard}\n" in out
    model = build_causal_lm(Qwen3MoEConfig(**MOE_ARCH))  # type: ignore[arg-type]
    total = sum(p.numel() for p in model.parameters())
    assert f"parameters: {total:,} total" in out and f"{total:,} trainable (100.00%)" in out
    assert "ranks 0-1 (pp=0): parameters" in out and "ranks 2-3 (pp=1): parameters" in out
    # the layers each stage holds (the default even split: the embedding and the head one layer each)
    first, second = split_layers(StageCosts.uniform(MOE_ARCH["num_layers"]), 2)
    last = MOE_ARCH["num_layers"] - 1
    assert f"pipeline: stage 0: layers 0-{first - 1} (" in out
    assert f"pipeline: stage 1: layers {first}-{last} (" in out and first + second == last + 1
    assert "nothing was started" in out
    # Nothing distributed exists afterwards: no process group, no Ray.
    assert not torch.distributed.is_initialized()
    if "ray" in sys.modules:
        assert not sys.modules["ray"].is_initialized()


def test_dry_run_shards_the_experts_with_fsdp_without_expert_parallelism(tmp_path: Path) -> None:
    """With `expert_parallel` 1 the decoder plan leaves the experts to FSDP (tests/test_parallel_qwen3.py
    checks the shards); the estimate halves them with the rest, and counts them in the gathered model."""

    def memory(mesh: dict[str, int], fsdp: dict[str, Any]) -> Any:
        model = {"provider": "qwen3_moe", "options": {"architecture": MOE_ARCH, "parallel": {"fsdp": fsdp}}}
        (estimate,) = dry_run(parse_config(_job(tmp_path, model=model, mesh=mesh))).memory
        return estimate

    model = build_causal_lm(Qwen3MoEConfig(**MOE_ARCH))  # type: ignore[arg-type]
    sizes = [(n, p.numel()) for n, p in model.named_parameters()]
    experts = sum(k for n, k in sizes if ".experts." in n)
    halves = sum(-(-k // 2) for _, k in sizes)
    # Resharding after forward (over the size limit), the rank holds its shards, the units that stay
    # gathered (the head, last in forward order, and the root's final norm) and two of the others at once
    # (the one computing and the next, prefetched in backward): the embedding or a layer, the larger.
    resharding = held_while_resharding(sizes, 2, skip=())
    assert memory({"data_parallel_shard": 2}, {"keep_gathered_gib": 0}).parameters == 4 * (
        halves + resharding
    )
    # Kept gathered (the default for a model this small), the gathered experts are on the rank as well.
    assert memory({"data_parallel_shard": 2}, {}).parameters == 4 * sum(k for _, k in sizes)
    # Under expert parallelism the experts are split over ep, not FSDP: 4 ranks, ep 2, dp_shard 4.
    split = memory({"data_parallel_shard": 4, "expert_parallel": 2}, {"keep_gathered_gib": 0})
    rest = sum(-(-k // 4) for n, k in sizes if ".experts." not in n)
    held = held_while_resharding(sizes, 4, skip=(".experts.",))
    assert split.parameters == 4 * (experts // 2 + rest + held)


def held_while_resharding(sizes: list[tuple[str, int]], fsdp: int, skip: tuple[str, ...]) -> int:
    """Elements beyond its shards a rank holds when every unit but the last reshards after forward: the head
    (last unit) and the root's norm gathered, and 2 × the largest of the embedding and each layer (FSDP's
    default backward prefetch of one unit). `sizes`: the model's (name, numel); `skip`: what FSDP does not
    shard."""

    def beyond_shards(prefix: str) -> int:
        return sum(
            k - -(-k // fsdp) for n, k in sizes if n.startswith(prefix) and not any(s in n for s in skip)
        )

    layers = {n.split(".")[2] for n, _ in sizes if n.startswith("model.layers.")}
    moving = [beyond_shards("model.embed_tokens."), *(beyond_shards(f"model.layers.{i}.") for i in layers)]
    return beyond_shards("lm_head.") + beyond_shards("model.norm.") + 2 * max(moving)


def test_dry_run_counts_lora_parameters_and_shards_their_memory(tmp_path: Path) -> None:
    arch = {k: v for k, v in MOE_ARCH.items() if "expert" not in k and k != "moe_intermediate_size"}

    def report(fsdp: dict[str, Any]) -> DryRunReport:
        model = {
            "provider": "peft",
            "options": {
                "base": {"provider": "qwen3", "options": {"architecture": arch, "parallel": {"fsdp": fsdp}}},
                "method": {"kind": "lora", "target_modules": TARGETS, "rank": RANK},
            },
        }
        return dry_run(parse_config(_job(tmp_path, model=model, mesh={"data_parallel_shard": 2})))

    a = Qwen3Config(**arch)  # type: ignore[arg-type]
    q_out, v_out = a.num_attention_heads * a.head_dim, a.num_kv_heads * a.head_dim
    per_layer = RANK * (
        (a.hidden_size + q_out) + (a.hidden_size + v_out) + (a.intermediate_size + a.hidden_size)
    )
    lora = a.num_layers * per_layer
    base = sum(p.numel() for p in build_causal_lm(a).parameters())
    resharding = report({"keep_gathered_gib": 0})
    assert resharding.parameters.trainable == lora
    assert resharding.parameters.total == base + lora
    (memory,) = resharding.memory
    assert memory.ranks == (0, 1)
    # FSDP over two ranks halves everything (and the head, the final norm and two units at a time are
    # gathered); fp32 gradients of the LoRA factors; AdamW keeps two moments.
    sizes = [(n, p.numel()) for n, p in build_causal_lm(a).named_parameters()]
    sizes += [(f"model.layers.{i}.lora", per_layer) for i in range(a.num_layers)]  # even sizes: halves exact
    assert memory.parameters == (base + lora) * 4 // 2 + 4 * held_while_resharding(sizes, 2, skip=())
    assert memory.gradients == lora * 4 // 2
    assert memory.optimizer == 2 * memory.gradients
    assert memory.activations is not None and memory.activations > 0
    # The default `auto` keeps a model this small gathered from forward to backward: all of it on a rank.
    (kept,) = report({}).memory
    assert kept.parameters == (base + lora) * 4
    assert any("stay gathered" in note for note in kept.notes)
    # ... and groups 4 layers per FSDP unit there (`layers_per_unit: auto`), one where the units reshard.
    assert "FSDP units: 4 decoder layer(s) per unit (fsdp.layers_per_unit auto)" in kept.notes
    assert "FSDP units: 1 decoder layer(s) per unit (fsdp.layers_per_unit auto)" in memory.notes
    (fixed,) = report({"layers_per_unit": 2}).memory
    assert "FSDP units: 2 decoder layer(s) per unit (fsdp.layers_per_unit 2)" in fixed.notes
    assert (kept.optimizer, kept.activations) == (memory.optimizer, memory.activations)
    # Kept gathered, `reduce_every: auto` reduces once per step over the job's microbatches: each rank holds
    # the whole (fp32) LoRA gradients through the step, not its half.
    assert parse_config(_job(tmp_path)).batching.gradient_accumulation(2) > 1
    assert kept.gradients == lora * 4 and any("reduces once per step" in note for note in kept.notes)
    (per_microbatch,) = report({"reduce_every": "microbatch"}).memory
    assert per_microbatch.gradients == memory.gradients and per_microbatch.parameters == kept.parameters
    assert not any("reduces once per step" in note for note in per_microbatch.notes)
    # `step` over the size limit keeps the units gathered through the step: the same as kept
    (stepped,) = report({"keep_gathered_gib": 0, "reduce_every": "step"}).memory
    assert (stepped.parameters, stepped.gradients) == (kept.parameters, kept.gradients)


def test_dry_run_reports_a_bad_layout_by_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(tmp_path, cluster={"num_workers": 3})))
    assert main(["train", str(path), "--dry-run"]) == 2
    assert "cluster.num_workers" in capsys.readouterr().err


# -- export -------------------------------------------------------------------------------------------


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
        initializer_range=0.3,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    transformers.GenerationConfig(max_new_tokens=7, eos_token_id=1, pad_token_id=0).save_pretrained(path)
    return path


def _train(env: RankEnv, source: Path, run_dir: Path) -> None:
    raw = {
        "run": {"name": "lora", "dir": str(run_dir)},
        "mesh": {"data_parallel_shard": 2},
        "batching": {"global_batch_size": 8, "microbatch_size": 4},
        "trainer": {"total_steps": 4},
        "logging": {"progress_bar": "off", "period": 4},
        "checkpointing": {"trainable_only": True},
        "model": {
            "provider": "peft",
            "options": {
                "base": {"provider": "qwen3", "options": {"source_checkpoint": str(source)}},
                "method": {"kind": "lora", "target_modules": TARGETS, "rank": RANK, "alpha": ALPHA},
            },
        },
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 2e-2, "weight_decay": 0.0}},
    }
    config = parse_config(raw)
    ctx = DistributedContext.create(config.mesh)
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, 2))
    trainer.setup()
    assert trainer.train().status == "finished"
    module = trainer.modules[0].eval()
    with torch.no_grad():  # every FSDP rank takes part in the forward
        logits = module(input_ids=IDS)["logits"]
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if env.rank == 0:
        torch.save(logits.detach().clone(), run_dir / "d9d_logits.pt")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    source = _source(tmp_path_factory.mktemp("source"))
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    run_dir.mkdir()
    run_distributed(_train, 2, source, run_dir, timeout=240)
    return source, run_dir


def _hf_logits(path: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=IDS).logits
    return logits


@pytest.mark.distributed
def test_merged_export_reproduces_the_trained_model(trained: tuple[Path, Path], tmp_path: Path) -> None:
    source, run_dir = trained
    dest = tmp_path / "merged"
    assert main(["export", str(run_dir), "--hf", str(dest), "--merged"]) == 0
    reference = torch.load(run_dir / "d9d_logits.pt")
    torch.testing.assert_close(_hf_logits(dest), reference, rtol=1e-5, atol=1e-5)
    # Training moved the model: the export is not simply the source checkpoint.
    assert (_hf_logits(source) - reference).abs().max() > 1e-3
    for name in SIDE:
        assert (dest / name).read_bytes() == (source / name).read_bytes(), name
    assert transformers.AutoTokenizer.from_pretrained(dest).eos_token == "<eos>"


@pytest.mark.distributed
def test_adapter_export_loads_offline_with_auto_peft(trained: tuple[Path, Path], tmp_path: Path) -> None:
    source, run_dir = trained
    dest = tmp_path / "adapter"
    assert main(["export", str(run_dir), "--step", "4", "--hf", str(dest), "--adapter"]) == 0
    config = json.loads((dest / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(source.resolve())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    tensors = load_file(dest / "adapter_model.safetensors")
    lora_b = [t for k, t in tensors.items() if k.endswith("lora_B.weight")]
    assert len(lora_b) == 3 * 2 and all(t.abs().max() > 0 for t in lora_b)  # trained, not the zero init
    for name in SIDE:
        assert (dest / name).read_bytes() == (source / name).read_bytes(), name
    # A fresh interpreter, offline: peft must find the base by the adapter config's name alone.
    script = (
        "import sys, torch\n"
        "from peft import AutoPeftModelForCausalLM\n"
        "model = AutoPeftModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "ids = torch.load(sys.argv[2])\n"
        "with torch.no_grad():\n"
        "    torch.save(model(input_ids=ids).logits, sys.argv[3])\n"
    )
    torch.save(IDS, tmp_path / "ids.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-c", script, str(dest), str(tmp_path / "ids.pt"), str(tmp_path / "peft.pt")],
        check=True,
        env=env,
        timeout=120,
    )
    reference = torch.load(run_dir / "d9d_logits.pt")
    torch.testing.assert_close(torch.load(tmp_path / "peft.pt"), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.distributed
def test_export_needs_only_the_model_and_checks_the_logits(
    trained: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The run trained with a data provider from `tests.engine_fixtures`; where that module cannot be
    imported (an example's `data.py` outside the repository) the export still works: it rebuilds the
    model only. `--check` loads the export in transformers and prints how far its logits are from d9d's."""
    _, run_dir = trained
    monkeypatch.setitem(sys.modules, "tests.engine_fixtures", None)  # `import` of it now fails
    with pytest.raises(ImportError):
        importlib.import_module("tests.engine_fixtures")
    capsys.readouterr()
    assert main(["export", str(run_dir), "--hf", str(tmp_path / "merged"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "check: the exported model's logits in transformers match d9d's logits: " in out, out
    assert "max |logit difference| " in out and "probe tokens" in out, out


def test_export_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "out")]) == 2
    assert "no checkpoints" in capsys.readouterr().err
    (tmp_path / "checkpoints").mkdir()
    assert main(["export", str(tmp_path), "--step", "3", "--hf", str(tmp_path / "out")]) == 2
    assert "step 3 is not a committed checkpoint" in capsys.readouterr().err


# -- help ---------------------------------------------------------------------------------------------


def test_every_option_of_every_command_has_help() -> None:
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    described = {a.dest: a.help for a in commands._choices_actions}
    assert {"train", "submit", "status", "logs", "stop", "demo", "export", "config-reference"} <= set(
        commands.choices
    )
    missing = []
    for name, sub in commands.choices.items():
        if not described.get(name):
            missing.append(name)
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, missing
