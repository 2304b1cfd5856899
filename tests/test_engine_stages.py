"""The stage builder shared by training and inference: what each stage looks like when it reaches the
compile hook, and the `Stages` value it returns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from d9d.engine.stages import Stages
from d9d.pipeline.api import PipelineStageInfo
from tests.harness import RankEnv, run_distributed


def _build(env: RankEnv) -> None:
    import d9d.engine.stages as stages_module
    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.parallel.compile import CompileConfig, CompileReport
    from tests.engine_fixtures import TinyLM, TinyLMProvider

    seen: list[dict[str, object]] = []

    def record(
        stage: nn.Module, config: CompileConfig, device: torch.device, *, split_backward: bool
    ) -> CompileReport:
        seen.append(
            {
                "meta": any(p.is_meta for p in stage.parameters()),
                "training": stage.training,
                "mode": config.mode,
                "device": device.type,
                "split_backward": split_backward,
                "weight": stage.hidden.weight.detach().clone(),
            }
        )
        return CompileReport(enabled=False, regions=(), reason="recorded by the test")

    stages_module.compile_stage = record  # the builder's hook (d9d.parallel.compile)
    ctx = DistributedContext.create(DeviceMeshParameters(), backend="gloo")
    provider = TinyLMProvider(TinyLMProvider.Config(width=4))
    infos = [PipelineStageInfo(0, 2), PipelineStageInfo(1, 2)]
    config = CompileConfig(mode="max-autotune-no-cudagraphs")
    built = stages_module.build_stages(
        provider, infos, ctx, parameter_seed=7, compile_config=config, training=False
    )
    assert [type(m) for m in built.modules] == [TinyLM, TinyLM]
    assert list(built.by_index) == [0, 1]
    assert len(seen) == 2  # once per stage
    for record_, module in zip(seen, built.modules, strict=True):
        assert record_ == {
            **record_,
            "meta": False,
            "training": False,
            "mode": config.mode,
            "device": "cpu",
            "split_backward": False,
        }
        # Compiled after initialization: the hook saw the final weights.
        torch.testing.assert_close(record_["weight"], module.hidden.weight.detach())
    trained = stages_module.build_stages(
        provider, infos[:1], ctx, parameter_seed=7, compile_config=config, training=True, split_backward=True
    )
    assert trained.modules[0].training
    assert seen[-1]["split_backward"] is True  # a zero-bubble schedule's stages keep their saved buffers
    # Initialized under the given parameter seed: a rebuild draws the same weights.
    torch.testing.assert_close(trained.modules[0].hidden.weight, built.modules[0].hidden.weight)


@pytest.mark.distributed
def test_stages_reach_the_compile_hook_materialized_and_initialized(tmp_path: Path) -> None:
    run_distributed(_build, 1, tmp_dir=tmp_path, timeout=120)


def test_stages_value_checks_infos_against_modules() -> None:
    with pytest.raises(ValueError, match="1 stage infos for 2 stage modules"):
        Stages((PipelineStageInfo(),), (nn.Linear(1, 1), nn.Linear(1, 1)))
    with pytest.raises(ValueError, match="0 stage infos for 0 stage modules"):
        Stages((), ())


def test_a_compile_config_that_cannot_work_here_fails_before_any_stage_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`compile.enabled: true` where compilation cannot work (here: no C++ compiler for inductor on CPU)
    is a config error naming the reason, raised before the provider builds anything."""
    import d9d.engine.stages as stages_module
    from d9d.core import DistributedContext
    from d9d.engine.errors import ConfigError
    from d9d.parallel.compile import CompileConfig
    from tests.engine_fixtures import TinyLMProvider

    class NoCompiler(RuntimeError):
        pass

    def no_compiler() -> str:
        raise NoCompiler("no working C++ compiler found")

    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
    built: list[PipelineStageInfo] = []

    class Recording(TinyLMProvider):
        def build_stage(self, stage: PipelineStageInfo) -> nn.Module:
            built.append(stage)
            return super().build_stage(stage)

    ctx = DistributedContext.local("cpu")
    with pytest.raises(ConfigError, match=r"compile\.enabled on cpu needs a C\+\+ compiler"):
        stages_module.build_stages(
            Recording(TinyLMProvider.Config(width=4)),
            [PipelineStageInfo()],
            ctx,
            parameter_seed=0,
            compile_config=CompileConfig(enabled=True),
            training=True,
        )
    assert not built


@pytest.mark.parametrize(
    ("split_backward", "enabled", "modules", "deferred", "warned"),
    [
        (True, True, 28, False, True),
        (False, True, 28, False, False),
        (True, False, 0, False, False),
        (True, True, 0, False, False),
        (True, True, 28, True, False),  # compile.defer_weight_grads: the weight passes get the projections
    ],
)
def test_a_split_backward_schedule_over_compiled_regions_is_warned_about(
    caplog: pytest.LogCaptureFixture,
    split_backward: bool,
    enabled: bool,
    modules: int,
    deferred: bool,
    warned: bool,
) -> None:
    """Zero-bubble schedules defer no weight gradient of a compiled block: the build says so, once, where it
    applies (compiled regions present, a schedule that splits backward, the projections compiled with the
    block), naming `compile.defer_weight_grads` as a remedy, and nowhere else."""
    import logging
    from types import SimpleNamespace

    from d9d.engine.stages import _log_compile
    from d9d.parallel.compile import CompileReport

    logger = logging.getLogger("test-stages-compile")
    ctx = SimpleNamespace(is_main_process=True, logger=logger)
    report = CompileReport(
        enabled=enabled,
        regions=("decoder_blocks",),
        reason="test",
        modules=modules,
        deferred_weight_grads=deferred,
    )
    with caplog.at_level(logging.INFO, logger=logger.name):
        _log_compile(ctx, [report, report], split_backward=split_backward)  # type: ignore[arg-type]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == (1 if warned else 0)
    if warned:
        assert "weight gradients in the input pass" in warnings[0].getMessage()
        assert "1f1b" in warnings[0].getMessage()
        assert "compile.defer_weight_grads: true" in warnings[0].getMessage()
