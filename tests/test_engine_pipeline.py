"""The engine with pipeline parallelism: tiny Qwen3 on pp2 under every schedule, and the gpu.yaml layout
(pp2 × fsdp2 × ep2), equal one process on the built-in text provider's batches; schedule errors at config
time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.launch import run_rank
from d9d.engine.runtime import RankRuntime
from tests.engine_fixtures import make_hf_qwen3
from tests.harness import RankEnv, run_distributed


def _config(run_dir: Path, pp: int, schedule: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "run": {"name": "pp", "dir": str(run_dir)},
        "mesh": {"pipeline_parallel": pp},
        "pipelining": schedule,
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 4},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"save_at_end": False},
        "model": {"provider": "qwen3", "options": {"source_checkpoint": str(run_dir.parent / "hf")}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


def test_schedule_errors_at_config_time(tmp_path: Path) -> None:
    make_hf_qwen3(tmp_path / "hf", num_layers=6)
    raw = _config(tmp_path / "run", 2, {"kind": "dualpipev"})  # source_checkpoint: tmp_path / "hf"
    raw["batching"] = {"global_batch_size": 4, "microbatch_size": 2}  # 2 microbatches < 2·pp - 1
    with pytest.raises(ConfigError, match=r"pipelining \(dualpipev, 2 microbatches per step\).*at least"):
        parse_config(raw)


def test_stage_split_errors_at_config_time(tmp_path: Path) -> None:
    make_hf_qwen3(tmp_path / "hf", num_layers=6)
    raw = _config(tmp_path / "run", 2, {"kind": "1f1b"})
    raw["model"]["options"]["parallel"] = {"stage_split": {"kind": "layers", "layers": [4, 1]}}
    with pytest.raises(ConfigError, match=r"stage_split layers\): stage layer counts \[4, 1\] .* 6 layers"):
        parse_config(raw)


# -- real batches: the built-in text provider's collate (padding side, documents, packing) ----------------

_CORPUS = [f"document {i}: " + "abcdefghij"[: 1 + i % 10] * (1 + i % 4) for i in range(64)]


def _text_config(
    tmp: Path, name: str, mesh: dict[str, int], schedule: str | None, data: str
) -> dict[str, Any]:
    """`data`: `padded` (one document a row, right padding + attention mask + padding_side), `packed`
    (rows of 48 tokens, segment ids), `hf` (a Hugging Face json-lines dataset, padded)."""
    dataset: dict[str, Any] = {"paths": [str(tmp / "corpus.txt")], "max_length": 48}
    if data == "hf":
        dataset = {
            "source": "hf",
            "paths": [str(tmp / "corpus.jsonl")],
            "max_length": 48,
            "cache_dir": str(tmp / "hfc"),
        }
    options: dict[str, Any] = {"dataset": dataset}
    if data == "packed":
        options["pack_length"] = 48
    moe = mesh.get("expert_parallel", 1) > 1 or name.startswith("moe")
    return {
        "run": {"name": name, "dir": str(tmp / name)},
        "mesh": mesh,
        "pipelining": None if schedule is None else {"kind": schedule},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 3},
        "logging": {"progress_bar": "off", "period": 1},
        "checkpointing": {"save_at_end": False},
        "model": {
            "provider": "qwen3_moe" if moe else "qwen3",
            "options": {"source_checkpoint": str(tmp / ("hf-moe" if moe else "hf-dense"))},
        },
        "data": {"provider": "text", "options": options},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


def _text_runs(
    env: RankEnv,
    runs: list[tuple[str, dict[str, int], str | None, str]],
    compile_section: dict[str, Any] | None = None,
    fused_adam: bool = False,
    stage_layers: dict[str, list[int]] | None = None,
) -> None:
    for name, mesh, schedule, data in runs:
        raw = _text_config(env.tmp_dir, name, mesh, schedule, data)
        if stage_layers and name in stage_layers:
            split = {"kind": "layers", "layers": stage_layers[name]}
            raw["model"]["options"]["parallel"] = {"stage_split": split}
        if compile_section is not None:
            raw["compile"] = compile_section
        if fused_adam:
            raw["optimizer"]["options"]["fused"] = True
        config = parse_config(raw)
        runtime = RankRuntime(
            rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
        )
        result = run_rank(config, runtime, LocalRunReporter(config.checkpoint_dir, 1))
        if env.rank == 0:
            torch.save(list(result.losses), env.tmp_dir / f"{name}.pt")


def _write_corpus(tmp: Path) -> None:
    import json

    (tmp / "corpus.txt").write_text("\n".join(_CORPUS) + "\n")
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": line}) + "\n" for line in _CORPUS))


@pytest.mark.distributed
def test_pipelines_train_on_the_text_providers_batches(tmp_path: Path) -> None:
    """Every schedule takes the real collate's microbatches (padding side as a string entry, attention mask,
    document ids when packed, a Hugging Face dataset) and equals one process on the same data."""
    from tests.engine_fixtures import make_hf_qwen3

    _write_corpus(tmp_path)
    make_hf_qwen3(tmp_path / "hf-dense", num_layers=6, vocab_size=259)
    cells = [  # (schedule, data): each schedule once, each data kind under a split and an unsplit schedule
        ("1f1b", "padded"),
        ("zbv", "padded"),
        ("zb1p", "packed"),
        ("dualpipev", "packed"),
        ("interleaved_1f1b", "hf"),
        ("zbv", "hf"),
        ("gpipe", "padded"),
    ]
    datas = sorted({d for _, d in cells})
    run_distributed(_text_runs, 1, [(f"one-{d}", {}, None, d) for d in datas], tmp_dir=tmp_path, timeout=300)
    pp = [(f"pp2-{s}-{d}", {"pipeline_parallel": 2}, s, d) for s, d in cells]
    # uneven stages given by `model.options.parallel.stage_split`
    uneven = {"pp2-1f1b-5.1": [5, 1], "pp2-zbv-1.3.1.1": [1, 3, 1, 1]}
    pp += [(name, {"pipeline_parallel": 2}, name.split("-")[1], "padded") for name in uneven]
    run_distributed(_text_runs, 2, pp, None, False, uneven, tmp_dir=tmp_path, timeout=600)
    for name, _, _, data in pp:
        reference = torch.tensor(torch.load(tmp_path / f"one-{data}.pt"))
        losses = torch.tensor(torch.load(tmp_path / f"{name}.pt"))
        assert len(reference) == 3
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_zbv_with_compiled_blocks_and_deferred_weight_grads_equals_one_process(tmp_path: Path) -> None:
    """ZBV and DualPipeV over compiled blocks whose projections stay eager (`compile.defer_weight_grads`,
    aot_eager: the same graphs as inductor without its slow CPU code generation), against one eager
    process."""
    _write_corpus(tmp_path)
    make_hf_qwen3(tmp_path / "hf-dense", num_layers=6, vocab_size=259)
    run_distributed(_text_runs, 1, [("one-padded", {}, None, "padded")], tmp_dir=tmp_path, timeout=300)
    runs = [(f"pp2-{s}-deferred", {"pipeline_parallel": 2}, s, "padded") for s in ("zbv", "dualpipev")]
    compile_section = {"enabled": True, "backend": "aot_eager", "defer_weight_grads": True}
    run_distributed(_text_runs, 2, runs, compile_section, tmp_dir=tmp_path, timeout=300)
    reference = torch.tensor(torch.load(tmp_path / "one-padded.pt"))
    for name, *_ in runs:
        losses = torch.tensor(torch.load(tmp_path / f"{name}.pt"))
        assert len(losses) == 3 and losses[-1] < losses[0], name
        torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_deferred_weight_grads_with_fsdp_and_expert_parallel_equal_one_process(tmp_path: Path) -> None:
    """`compile.defer_weight_grads` where its weight passes meet FSDP's reduce-scatter and the expert
    exchange: pp 2 × dp_shard 2 × ep 2 under ZBV (the MoE example's layout, its checkpoint's balancing
    loss weighted 0.001) and dense pp 2 × dp_shard 2 under ZB1P, compiled (aot_eager), against one
    eager process."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    _write_corpus(tmp_path)
    make_hf_qwen3(tmp_path / "hf-dense", num_layers=6, vocab_size=259)
    make_hf_qwen3_moe(tmp_path / "hf-moe", num_layers=6, vocab_size=259)
    references = [("one-padded", {}, None, "padded"), ("moe-one", {}, None, "padded")]
    run_distributed(_text_runs, 1, references, tmp_dir=tmp_path, timeout=300)
    runs = [
        (
            "moe-pp2-fsdp2-ep2-zbv",
            {"pipeline_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2},
            "zbv",
        ),
        ("pp2-fsdp2-zb1p", {"pipeline_parallel": 2, "data_parallel_shard": 2}, "zb1p"),
    ]
    compile_section = {"enabled": True, "backend": "aot_eager", "defer_weight_grads": True}
    run_distributed(
        _text_runs,
        4,
        [(name, mesh, schedule, "padded") for name, mesh, schedule in runs],
        compile_section,
        tmp_dir=tmp_path,
        timeout=600,
    )
    for (name, _, _), reference in zip(runs, ("moe-one", "one-padded"), strict=True):
        want = torch.tensor(torch.load(tmp_path / f"{reference}.pt"))
        losses = torch.tensor(torch.load(tmp_path / f"{name}.pt"))
        assert len(losses) == 3 and losses[-1] < losses[0], name
        torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.distributed
def test_gpu_example_layout_trains_like_one_process_on_gloo(tmp_path: Path) -> None:
    """The layout of examples/qwen3_moe_pretrain/gpu.yaml at 4 ranks — pp 2 × dp_shard 2 × ep 2 under ZBV,
    the text provider's padded batches — against one process on the same global batch (one dp rank with
    twice the microbatches sees the same documents; the token-weighted loss does not depend on which
    documents share a microbatch). The layout steps fused AdamW, as on CUDA by default (the loss weight and
    clipping then divide inside the optimizer), the reference foreach AdamW (divided in place)."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    _write_corpus(tmp_path)
    make_hf_qwen3_moe(tmp_path / "hf-moe", num_layers=6, vocab_size=259)
    run_distributed(_text_runs, 1, [("moe-one", {}, None, "padded")], tmp_dir=tmp_path, timeout=300)
    mesh = {"pipeline_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2}
    run_distributed(
        _text_runs,
        4,
        [("moe-pp2-fsdp2-ep2", mesh, "zbv", "padded")],
        None,
        True,
        tmp_dir=tmp_path,
        timeout=600,
    )
    reference = torch.tensor(torch.load(tmp_path / "moe-one.pt"))
    losses = torch.tensor(torch.load(tmp_path / "moe-pp2-fsdp2-ep2.pt"))
    assert len(losses) == 3 and losses[-1] < losses[0]
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6)
