"""Failing fast: the driver's preflight (before Ray), errors that a retry cannot fix, YAML errors with their
position, and data parallelism without gradient sync refused at setup. No Ray instance is started here."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from torch import nn

from d9d.cli.main import main
from d9d.cluster import TrainingJob
from d9d.cluster.control.failure import FailurePolicy, GiveUp, NonRetryableError, is_retryable
from d9d.cluster.control.runner import failed
from d9d.cluster.spec import build_job
from d9d.engine.config import ConfigError
from tests.cluster_fixtures import toy_job
from tests.harness import RankEnv, run_distributed

ARCH = {
    "vocab_size": 259,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
}
MOE = {**ARCH, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}


def _engine_job(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\nsecond line\n")
    job: dict[str, Any] = {
        "run": {"name": "pre", "dir": str(tmp_path / "run")},
        "mesh": {"data_parallel_shard": 2},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": 2},
        "model": {"provider": "qwen3", "options": {"architecture": ARCH}},
        "data": {"provider": "text", "options": {"dataset": {"paths": [str(corpus)]}}},
    }
    job.update(copy.deepcopy(sections))
    return job


def _refused(job: dict[str, Any]) -> str:
    """Start the job; it must be refused with a ConfigError before Ray is touched."""
    assert not ray.is_initialized()
    with pytest.raises(ConfigError) as info:
        TrainingJob(build_job(job)).start()
    assert not ray.is_initialized()
    return str(info.value)


# -- the driver's preflight ----------------------------------------------------------------------------------


def test_a_sane_engine_job_passes_preflight(tmp_path: Path) -> None:
    from d9d.cluster.client import preflight_job

    preflight_job(build_job(_engine_job(tmp_path)))  # the reference for every refusal below


def test_missing_data_file_is_refused_naming_field_and_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    job = _engine_job(tmp_path, data={"provider": "text", "options": {"dataset": {"paths": [str(missing)]}}})
    message = _refused(job)
    assert "data.options.dataset.paths[0]" in message and str(missing) in message


def test_d9d_train_refuses_a_missing_data_file_with_status_2_before_ray(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _engine_job(tmp_path)
    job["data"]["options"]["dataset"]["paths"] = ["missing/corpus.txt"]
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "d9d train: data.options.dataset.paths[0]: missing/corpus.txt does not exist" in err
    assert "Traceback" not in err and not ray.is_initialized()


def test_tokenizer_that_does_not_load_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    dataset = {"paths": [str(tmp_path / "corpus.txt")], "tokenizer": {"kind": "hf", "path": str(broken)}}
    (tmp_path / "corpus.txt").write_text("x\n")
    job = _engine_job(tmp_path)
    job["data"] = {"provider": "text", "options": {"dataset": dataset}}
    assert "data.options.dataset.tokenizer: does not load" in _refused(job)


@pytest.mark.parametrize(
    ("mesh", "model", "wanted"),
    [
        (
            {"data_parallel_shard": 1, "tensor_parallel": 3},
            {"provider": "qwen3", "options": {"architecture": {**ARCH, "num_kv_heads": 4}}},
            "num_attention_heads=4 is not divisible by mesh.tensor_parallel=3",
        ),
        (
            {"data_parallel_shard": 3, "expert_parallel": 3},
            {"provider": "qwen3_moe", "options": {"architecture": MOE}},
            "num_experts=4 is not divisible by mesh.expert_parallel=3",
        ),
    ],
)
def test_model_sizes_the_mesh_cannot_split_are_refused(
    tmp_path: Path, mesh: dict[str, int], model: dict[str, Any], wanted: str
) -> None:
    job = _engine_job(tmp_path, mesh=mesh, model=model)
    job["batching"] = {"global_batch_size": 6, "microbatch_size": 1}
    assert wanted in _refused(job)


@pytest.mark.parametrize(
    ("entrypoint", "wanted"),
    [
        ("tests.no_such_module:run", "does not import"),
        ("tests.cluster_fixtures:no_such_run", "names nothing"),
    ],
)
def test_entrypoint_that_does_not_import_is_refused(tmp_path: Path, entrypoint: str, wanted: str) -> None:
    job = toy_job("entry", tmp_path)
    job["cluster"] = {**job["cluster"], "entrypoint": entrypoint}
    message = _refused(job)
    assert message.startswith(f"cluster.entrypoint: {entrypoint!r} {wanted}")


def test_incomplete_or_misshapen_hf_source_checkpoint_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from tests.engine_fixtures import make_hf_qwen3

    source = tmp_path / "hf"
    make_hf_qwen3(source)
    job = _engine_job(tmp_path, model={"provider": "qwen3", "options": {"source_checkpoint": str(source)}})
    # A tokenizer of the model's 32 ids (the byte tokenizer's 259 would be refused: the vocabulary check).
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 32)}}
    Tokenizer(models.WordLevel(vocab, unk_token="<pad>")).save(str(tmp_path / "tokenizer.json"))
    job["data"]["options"]["dataset"]["tokenizer"] = {
        "kind": "hf",
        "path": str(tmp_path / "tokenizer.json"),
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    from d9d.cluster.client import preflight_job

    spec = build_job(job)
    preflight_job(spec)  # the intact checkpoint passes

    weights = source / "model.safetensors"
    tensors = load_file(weights)
    key = "model.layers.1.mlp.up_proj.weight"
    tensors[key] = tensors[key][:32].clone()
    save_file(tensors, weights, metadata={"format": "pt"})
    message = _refused(job)
    assert "model.options.source_checkpoint" in message and key in message and "(64, 32)" in message

    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    message = _refused(job)
    assert "lacks model.layers.0.self_attn.q_proj.weight" in message and str(weights) in message


def test_heartbeat_timeout_must_be_well_above_the_interval(tmp_path: Path) -> None:
    job = toy_job("hb", tmp_path)
    job["cluster"] = {**job["cluster"], "heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 2.0}
    with pytest.raises(ConfigError, match=r"cluster.heartbeat_timeout_s=2.0 must be at least 3"):
        build_job(job)


# -- errors a retry cannot fix -------------------------------------------------------------------------------


def _read_shard(path: Path) -> bytes:
    return path.read_bytes()


def _chained_setup_error(path: Path) -> FileNotFoundError:
    try:
        _read_shard(path)
    except FileNotFoundError as e:
        try:
            raise FileNotFoundError("the data shard of rank 1 is missing") from e
        except FileNotFoundError as outer:
            return outer
    raise AssertionError("the file exists")


def test_setup_errors_before_the_first_step_are_not_retried_and_keep_the_chain(tmp_path: Path) -> None:
    error = _chained_setup_error(tmp_path / "shard-7.bin")
    assert not is_retryable(error, before_first_step=True)
    assert is_retryable(error, before_first_step=False)  # after a step the restart budget decides
    assert is_retryable(RuntimeError("gloo: connection reset"), before_first_step=True)
    assert not is_retryable(NonRetryableError("x"))

    outcome = failed("rank 1", error, before_first_step=True)
    assert outcome.reason == "rank 1: FileNotFoundError: the data shard of rank 1 is missing"
    decision = FailurePolicy(max_failures=3, backoff_s=1.0, max_backoff_s=1.0).decide(outcome)
    assert isinstance(decision, GiveUp)
    # The whole chain: the inner error with the file it names, the frames with this file's name.
    assert "shard-7.bin" in decision.error and "test_trust_preflight.py" in decision.error
    assert "direct cause" in decision.error and "_read_shard" in decision.error


# -- YAML errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["train", "submit"])
def test_malformed_job_file_exits_2_with_file_line_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("run:\n  name: x\nmesh: {data_parallel_shard: 2\nbatching: {}\n")
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:4:9: malformed YAML" in err
    assert "Traceback" not in err and "<unicode string>" not in err


def test_malformed_set_value_exits_2_naming_the_override(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(toy_job("set", tmp_path / "run")))
    assert main(["train", str(path), "--set", "trainer.total_steps=[1, 2"]) == 2
    err = capsys.readouterr().err
    assert "--set trainer.total_steps value '[1, 2':1:6: malformed YAML" in err and "Traceback" not in err


def test_malformed_json_job_names_line_and_column(tmp_path: Path) -> None:
    from d9d.engine.config import read_config_file

    path = tmp_path / "job.json"
    path.write_text('{"run": {"name": "x"},\n "mesh": }')
    with pytest.raises(ConfigError, match=rf"{path}:2:10: malformed JSON"):
        read_config_file(path)


# -- data parallelism without gradient sync ------------------------------------------------------------------


class _Unsynced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.synced = nn.Linear(4, 4)
        self.forgotten = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4).requires_grad_(False)

    def reset_parameters(self) -> None:
        for m in (self.synced, self.forgotten, self.frozen):
            m.reset_parameters()


class _ForgetfulProvider:
    """Replicates one submodule and forgets another, as a custom provider might."""

    def build_stage(self, stage: Any) -> nn.Module:
        return _Unsynced()

    def parallelize(self, module: nn.Module, ctx: Any) -> None:
        from d9d.parallel import parallelize_replicate

        assert isinstance(module, _Unsynced)
        parallelize_replicate(module.synced, ctx.mesh_for("batch")["dp"])

    def initialize(self, module: nn.Module, ctx: Any) -> None:
        assert isinstance(module, _Unsynced)
        module.reset_parameters()


def _build_unsynced(env: RankEnv) -> None:
    from d9d.core.context import DistributedContext
    from d9d.core.mesh_params import DeviceMeshParameters
    from d9d.engine.stages import build_stages
    from d9d.parallel.compile import CompileConfig
    from d9d.pipeline.api import PipelineStageInfo

    ctx = DistributedContext.create(DeviceMeshParameters(data_parallel_shard=env.world_size))
    provider: Any = _ForgetfulProvider()

    def build(training: bool) -> None:
        build_stages(
            provider,
            [PipelineStageInfo()],
            ctx,
            parameter_seed=0,
            compile_config=CompileConfig(enabled=False),
            training=training,
        )

    build(False)  # inference has no gradients to sync: nothing to refuse
    with pytest.raises(ConfigError) as info:
        build(True)
    message = str(info.value)
    listing = "2 trainable parameter(s) of stage 0 have no gradient sync: forgotten.weight, forgotten.bias."
    assert listing in message
    assert "synced." not in message and "frozen" not in message  # covered, and not trained


def test_data_parallel_stage_with_unsynced_parameters_is_refused_at_setup(tmp_path: Path) -> None:
    run_distributed(_build_unsynced, 2, tmp_dir=tmp_path)
