"""`compile.mode: reduce-overhead` (CUDA graphs of the compiled blocks): where the config accepts it, the
step mark that lets the graph trees replay, and that nothing is graphed off CUDA. Whether the graphs replay
and train like the default mode is the NCCL engine test (`tests/test_engine_gpu.py`, layouts
`dp2-cudagraphs`, `pp2-1f1b-cudagraphs` and `pp2-interleaved-cudagraphs`)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from d9d.engine.config import ConfigError, parse_config
from d9d.engine.inference import InferenceConfig
from d9d.parallel.compile import CompileConfig, CompileReport, begin_step, compile_stage
from tests.test_engine_builtin import ARCH
from tests.test_engine_config import BASE


def _job(mesh: dict[str, int], **sections: Any) -> dict[str, Any]:
    compile_section = {"mode": "reduce-overhead", **sections.pop("compile", {})}
    return {**BASE, "mesh": mesh, "compile": compile_section, **sections}


@pytest.mark.parametrize(
    ("mesh", "sections"),
    [
        ({}, {}),
        ({"pipeline_parallel": 2}, {"pipelining": {"kind": "1f1b"}}),
        ({"pipeline_parallel": 2}, {}),  # the default schedule, 1F1B
        ({"pipeline_parallel": 2}, {"pipelining": {"kind": "interleaved_1f1b"}}),
        ({"data_parallel_replicate": 2}, {}),
        ({"data_parallel_replicate": 4}, {}),
        # evaluation marks a graph step before each forward (tests/test_engine_gpu.py runs it under graphs)
        ({}, {"eval": {"data": {"provider": "tests.engine_fixtures:GlobalIndexData"}, "batch_size": 2}}),
        (
            {"pipeline_parallel": 2},
            {"eval": {"data": {"provider": "tests.engine_fixtures:GlobalIndexData"}, "batch_size": 2}},
        ),
    ],
)
def test_accepted_on_one_gpu_replicas_and_pipeline_stages_alone(
    mesh: dict[str, int], sections: dict[str, Any]
) -> None:
    config = parse_config(_job(mesh, **sections))
    assert config.compile.mode == "reduce-overhead"


@pytest.mark.parametrize(
    ("mesh", "sections", "message"),
    [
        ({"data_parallel_shard": 2}, {}, r"mesh\.data_parallel_shard = 2: supported on one GPU"),
        (
            {"data_parallel_replicate": 2, "data_parallel_shard": 2},
            {},
            r"mesh\.data_parallel_shard = 2: supported on one GPU, with data_parallel_replicate \(and",
        ),
        # a plug-in model: no capacity exchange to be sure of
        (
            {"data_parallel_replicate": 2, "expert_parallel": 2},
            {},
            r"mesh\.expert_parallel = 2: supported for the built-in families",
        ),
        (
            {"data_parallel_replicate": 2, "pipeline_parallel": 2},
            {"pipelining": {"kind": "1f1b"}},
            r"mesh\.data_parallel_replicate = 2 and mesh\.expert_parallel = 1: pipeline stages are supported",
        ),
        ({"tensor_parallel": 2}, {}, r"mesh\.tensor_parallel = 2"),
        (
            {"pipeline_parallel": 2, "data_parallel_shard": 2},
            {"pipelining": {"kind": "1f1b"}},
            r"mesh\.data_parallel_shard = 2",
        ),
        (
            {"pipeline_parallel": 2},
            {"pipelining": {"kind": "zbv"}},
            r"pipelining\.kind=zbv: supported with 1f1b",
        ),
        ({"pipeline_parallel": 2}, {"pipelining": {"kind": "gpipe"}}, r"pipelining\.kind=gpipe"),
        ({}, {"activation_checkpointing": {"mode": "full"}}, r"activation_checkpointing\.mode=full"),
        ({}, {"compile": {"regions": ["decoder_blocks", "loss_head"]}}, r"regions containing loss_head"),
    ],
)
def test_refused_at_config_time_where_not_measured(
    mesh: dict[str, int], sections: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(_job(mesh, **sections))


def _moe(backend: dict[str, Any]) -> dict[str, Any]:
    options = {"dtype": "bfloat16", "architecture": ARCH, "parallel": {"expert_backend": backend}}
    return {"provider": "qwen3_moe", "options": options}  # bf16: DeepEP's own check passes


CAPACITY = {"kind": "all_to_all", "capacity_factor": 1.25}


@pytest.mark.parametrize(
    "mesh",
    [
        {"data_parallel_replicate": 2, "expert_parallel": 2},
        {"data_parallel_replicate": 4, "expert_parallel": 2},
    ],
)
def test_expert_parallel_replicas_are_accepted_with_the_capacity_exchange(mesh: dict[str, int]) -> None:
    config = parse_config(_job(mesh, model=_moe(CAPACITY)))
    assert config.compile.mode == "reduce-overhead"


def test_an_eval_section_with_expert_parallelism_is_refused_under_graphs() -> None:
    """Evaluation takes the exchange that reads its split sizes (the capacity exchange is the training
    step's): its host reads would split the graphed blocks, not measured. Without EP the eval is accepted."""
    evaluation = {"data": {"provider": "tests.engine_fixtures:GlobalIndexData"}, "batch_size": 2}
    mesh = {"data_parallel_replicate": 2, "expert_parallel": 2}
    with pytest.raises(ConfigError, match=r"eval section and mesh\.expert_parallel = 2"):
        parse_config(_job(mesh, model=_moe(CAPACITY), eval=evaluation))
    parse_config(_job({"data_parallel_replicate": 2}, model=_moe(CAPACITY), eval=evaluation))


@pytest.mark.parametrize(
    ("mesh", "backend", "message"),
    [
        # the exchange that reads its split sizes: each MoE block in pieces around the read
        (
            {"data_parallel_replicate": 2, "expert_parallel": 2},
            {"kind": "all_to_all"},
            r"model\.options\.parallel\.expert_backend \{kind: all_to_all, capacity_factor",
        ),
        (
            {"data_parallel_replicate": 2, "expert_parallel": 2},
            {"kind": "auto"},
            r"expert_parallel = 2: supported with",
        ),
        (
            {"data_parallel_replicate": 2, "expert_parallel": 2},
            {"kind": "deep_ep"},
            r"DeepEP is not measured under graphs",
        ),
        # FSDP under the experts' exchange: refused for FSDP, whatever the exchange
        ({"data_parallel_shard": 2, "expert_parallel": 2}, CAPACITY, r"mesh\.data_parallel_shard = 2"),
        (
            {"pipeline_parallel": 2, "data_parallel_replicate": 2, "expert_parallel": 2},
            CAPACITY,
            r"expert-parallel pipeline stages are not measured",
        ),
    ],
)
def test_expert_parallel_is_refused_without_the_capacity_exchange_or_with_fsdp_or_stages(
    mesh: dict[str, int], backend: dict[str, Any], message: str
) -> None:
    sections: dict[str, Any] = {"model": _moe(backend)}
    if mesh.get("pipeline_parallel", 1) > 1:
        sections["pipelining"] = {"kind": "1f1b"}
    with pytest.raises(ConfigError, match=message):
        parse_config(_job(mesh, **sections))


def test_the_other_modes_and_backends_are_not_restricted() -> None:
    parse_config({**BASE, "compile": {"mode": "max-autotune-no-cudagraphs"}})  # BASE is FSDP 2
    # aot_eager generates no code, so no graphs
    parse_config(_job({"data_parallel_shard": 2}, compile={"backend": "aot_eager"}))
    # compilation off: the mode graphs nothing (with compilation on, the same layout is refused above)
    parse_config(_job({"data_parallel_shard": 2}, compile={"enabled": False}))


def test_inference_refuses_cuda_graphs() -> None:
    raw = {
        "run": {"name": "ppl", "dir": "/tmp/unused"},
        "microbatch_size": 2,
        "model": {"provider": "tests.engine_fixtures:TinyLMProvider", "options": {"width": 4}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "compile": {"mode": "reduce-overhead"},
    }
    with pytest.raises(ValueError, match="reduce-overhead is a training setting"):
        InferenceConfig.model_validate(raw)
    raw["compile"] = {"mode": "default"}
    InferenceConfig.model_validate(raw)


def test_begin_step_marks_only_where_a_stage_replays_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    marks: list[int] = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    plain = CompileReport(enabled=True, regions=("decoder_blocks",), reason="", modules=2)
    graphed = CompileReport(enabled=True, regions=("decoder_blocks",), reason="", modules=2, cuda_graphs=True)
    begin_step([])
    begin_step([plain, plain])
    assert marks == []
    begin_step([plain, graphed])
    assert marks == [1]


def test_begin_step_says_when_inductor_runs_a_graph_without_cuda_graphs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Inductor decides to skip CUDA graphs for a compiled graph (e.g. a mutated input) when it compiles or
    first runs it and only logs it under TORCH_LOGS: the step mark reads its counter and warns, once per new
    skip, on a stage that asked for graphs."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)
    monkeypatch.setitem(counters["inductor"], "cudagraph_skips", 0)
    graphed = CompileReport(enabled=True, regions=("decoder_blocks",), reason="", modules=2, cuda_graphs=True)
    plain = CompileReport(enabled=True, regions=("decoder_blocks",), reason="", modules=2)

    def warnings_after_step(reports: list[CompileReport]) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="d9d.parallel.compile"):
            begin_step(reports)
        return [r.getMessage() for r in caplog.records]

    assert warnings_after_step([graphed]) == []
    counters["inductor"]["cudagraph_skips"] += 2
    assert warnings_after_step([plain]) == []  # no graphs asked for: nothing skipped from the user's view
    (said,) = warnings_after_step([graphed])
    assert "runs 2 compiled graph(s) without CUDA graphs" in said and "TORCH_LOGS=cudagraphs" in said
    assert graphed.stats.cuda_graph_skips == 2
    assert warnings_after_step([graphed]) == []  # said once
    counters["inductor"]["cudagraph_skips"] += 1  # a graph compiled later (a retrace) skipped too
    assert len(warnings_after_step([graphed])) == 1


def test_graphs_are_released_when_training_ends_where_a_stage_recorded_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A CUDA graph that captured NCCL collectives keeps `destroy_process_group` from returning (measured on
    2 GPUs: `tests/test_engine_gpu.py`, `dp2xep2-capacity-cudagraphs`, hung at exit before this release)."""
    import torch._inductor.cudagraph_trees as trees

    from d9d.parallel.compile import release_cuda_graphs

    resets: list[int] = []
    monkeypatch.setattr(trees, "reset_cudagraph_trees", lambda: resets.append(1))
    plain = CompileReport(enabled=True, regions=("decoder_blocks",), reason="", modules=2)
    graphed = CompileReport(enabled=True, regions=("decoder_blocks",), reason="", modules=2, cuda_graphs=True)
    release_cuda_graphs([plain])
    assert resets == []
    release_cuda_graphs([plain, graphed])
    assert resets == [1]

    def broken() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    # the trainer calls it in a `finally`: a failure there must not replace the run's own error
    monkeypatch.setattr(trees, "reset_cudagraph_trees", broken)
    with caplog.at_level(logging.WARNING, logger="d9d.parallel.compile"):
        release_cuda_graphs([graphed])
    assert "freeing the CUDA graphs failed (RuntimeError: CUDA error" in caplog.text


def test_nothing_is_graphed_off_cuda() -> None:
    """Inductor graphs CUDA code only: on CPU the mode compiles as `default` and the report says no graphs
    (so no step is marked)."""
    from tests.test_parallel_compile import _model

    model = _model()
    config = CompileConfig(enabled=True, mode="reduce-overhead", backend="inductor")
    report = compile_stage(model, config, torch.device("cpu"))
    assert report.enabled and report.modules > 0
    assert not report.cuda_graphs


@pytest.mark.parametrize(
    ("mesh", "sections", "microbatches", "hinted"),
    [
        ({"data_parallel_replicate": 2}, {}, 4, True),
        ({"pipeline_parallel": 2}, {"pipelining": {"kind": "1f1b"}}, 8, True),
        ({}, {}, 4, False),  # one GPU accumulating several microbatches: not measured under graphs
        ({"data_parallel_replicate": 2}, {}, 1, False),  # one microbatch per step: measured the same speed
        ({"data_parallel_shard": 2}, {}, 4, False),  # refused there
        ({"pipeline_parallel": 2}, {"pipelining": {"kind": "zbv"}}, 8, False),
        ({"data_parallel_replicate": 2}, {"compile": {"mode": "reduce-overhead"}}, 4, False),  # already on
        ({"data_parallel_replicate": 2}, {"compile": {"mode": "max-autotune-no-cudagraphs"}}, 4, False),
    ],
)
def test_the_mode_is_suggested_where_it_is_accepted_and_a_step_has_several_microbatches(
    mesh: dict[str, int], sections: dict[str, Any], microbatches: int, hinted: bool
) -> None:
    hint = parse_config({**BASE, "mesh": mesh, **sections}).cuda_graphs_hint(microbatches)
    assert (hint is not None) == hinted, hint
    if hint is not None:
        assert "compile.mode: reduce-overhead" in hint and f"{microbatches} microbatches" in hint
