from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from d9d.engine.components import AdamW, BuiltinModel, ModelPlugin
from d9d.engine.config import ConfigError, apply_overrides, load_config, parse_config
from tests.test_engine_builtin import ARCH

BASE = {
    "run": {"name": "t"},
    "mesh": {"data_parallel_shard": 2},
    "batching": {"global_batch_size": 8, "microbatch_size": 2},
    "trainer": {"total_steps": 10},
    "model": {"provider": "tests.engine_fixtures:TinyLMProvider", "options": {"width": 4}},
    "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
    "task": {"provider": "tests.engine_fixtures:TokenCETask"},
    "optimizer": {"provider": "adamw", "options": {"lr": 1e-3}},
}


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_valid_config_and_derived_values(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, BASE))
    assert config.batching.gradient_accumulation(config.mesh.data_parallel) == 2
    assert config.run_dir == Path("runs/t")
    assert config.checkpoint_dir == Path("runs/t/checkpoints")


def test_overrides_are_typed_and_validated(tmp_path: Path) -> None:
    config = load_config(
        _write(tmp_path, BASE), ["trainer.total_steps=100", "optimizer.options.lr=1e-4", "run.description=hi"]
    )
    assert config.trainer.total_steps == 100
    assert isinstance(config.optimizer, AdamW)
    assert config.optimizer.options.lr == 1e-4
    with pytest.raises(ConfigError, match=r"trainer\.total_steps"):
        load_config(_write(tmp_path, BASE), ["trainer.total_steps=-1"])
    with pytest.raises(ConfigError, match="not of the form"):
        apply_overrides({}, ["trainer.total_steps"])
    with pytest.raises(ConfigError, match=r"run\.name is not a section"):
        apply_overrides({"run": {"name": "x"}}, ["run.name.first=1"])
    with pytest.raises(ConfigError, match=re.escape("give the whole list, e.g. --set 'data.paths=[a, b]'")):
        apply_overrides({"data": {"paths": ["a"]}}, ["data.paths[0]=b"])


def test_unknown_key_names_its_path() -> None:
    bad = {**BASE, "trainer": {"total_steps": 10, "totl_steps": 3}}
    with pytest.raises(ConfigError, match=r"trainer\.totl_steps: Extra inputs are not permitted"):
        parse_config(bad)


def test_global_batch_not_divisible() -> None:
    bad = {**BASE, "batching": {"global_batch_size": 6, "microbatch_size": 2}}
    with pytest.raises(ConfigError, match=r"global_batch_size=6 is not divisible by .* 2 × 2"):
        parse_config(bad)


def test_unknown_provider_and_bad_options() -> None:
    with pytest.raises(ConfigError, match=r"model\.provider: cannot import module 'no_such_pkg.mod'"):
        parse_config({**BASE, "model": {"provider": "no_such_pkg.mod:Model"}})
    with pytest.raises(ConfigError, match=r"model\.provider: unknown model provider 'qwen9'"):
        parse_config({**BASE, "model": {"provider": "qwen9"}})
    with pytest.raises(ConfigError, match=r"has no attribute 'Missing'"):
        parse_config({**BASE, "model": {"provider": "tests.engine_fixtures:Missing"}})
    with pytest.raises(ConfigError, match="must define a nested pydantic `Config`"):
        parse_config({**BASE, "model": {"provider": "tests.engine_fixtures:NotAProvider"}})
    with pytest.raises(
        ConfigError, match=r"model\.options\.width: Input should be greater than or equal to 1"
    ):
        parse_config(
            {
                **BASE,
                "model": {"provider": "tests.engine_fixtures:TinyLMProvider", "options": {"width": 0}},
            }
        )
    with pytest.raises(ConfigError, match=r"optimizer\.options\.lrr: Extra inputs"):
        parse_config({**BASE, "optimizer": {"provider": "adamw", "options": {"lrr": 1}}})


def test_plugin_must_implement_its_kinds_protocol() -> None:
    # WidthModelProvider has options but none of the methods the engine calls on a model provider.
    width = {"provider": "tests.engine_fixtures:WidthModelProvider", "options": {"width": 4}}
    with pytest.raises(
        ConfigError,
        match=r"model\.provider: tests\.engine_fixtures:WidthModelProvider is not a model provider "
        r"\(ModelProvider\); missing methods: build_stage, parallelize, initialize, export, subscribe",
    ):
        parse_config({**BASE, "model": width})
    # A training task where a data provider belongs: the protocol of the key decides.
    with pytest.raises(ConfigError, match=r"data\.provider: .*missing methods: setup, next_step, state_dict"):
        parse_config({**BASE, "data": {"provider": "tests.engine_fixtures:TokenCETask"}})


def test_builtin_options_are_typed_and_plugins_keep_their_path() -> None:
    qwen = {"provider": "qwen3", "options": {"architecture": _TINY_QWEN3}}
    config = parse_config({**BASE, "model": qwen})
    assert isinstance(config.model, BuiltinModel) and config.model.provider == "qwen3"
    assert config.model.options.architecture == _TINY_QWEN3
    plugin = parse_config(BASE).model
    assert isinstance(plugin, ModelPlugin)
    assert plugin.provider == "tests.engine_fixtures:TinyLMProvider"
    assert plugin.options == {"width": 4}
    # A built-in's option error names the key the user wrote (no union tag in the path).
    with pytest.raises(ConfigError, match=r"model\.options\.dtype: Input should be 'float32' or 'bfloat16'"):
        parse_config({**BASE, "model": {"provider": "qwen3", "options": {**qwen["options"], "dtype": "x"}}})
    # The config round-trips through its dump (how it is shipped to rank processes).
    assert parse_config(parse_config({**BASE, "model": qwen}).model_dump(mode="json")).model == config.model


_TINY_QWEN3 = {
    "vocab_size": 32,
    "hidden_size": 16,
    "num_layers": 1,
    "num_attention_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "intermediate_size": 32,
}


def test_schedule_longer_than_the_run_is_a_config_error() -> None:
    warmup = {"provider": "piecewise", "options": {"phases": [{"kind": "steps", "steps": 20, "target": 1.0}]}}
    with pytest.raises(
        ConfigError, match=r"lr_scheduler\.options: phases\[0\] ends at step 20, beyond total"
    ):
        parse_config({**BASE, "lr_scheduler": warmup})
    parse_config({**BASE, "trainer": {"total_steps": 20}, "lr_scheduler": warmup})


def test_bad_mesh_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"mesh: Value error, expert_parallel=3 must divide"):
        parse_config({**BASE, "mesh": {"data_parallel_shard": 2, "expert_parallel": 3}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cluster_section_is_left_to_the_cluster(tmp_path: Path) -> None:
    path = _write(tmp_path, {**BASE, "cluster": {"num_workers": 4}})
    with pytest.raises(ConfigError, match="cluster: Extra inputs"):
        load_config(path)
    assert load_config(path, ignore_sections=["cluster"]).run.name == "t"


def test_deferred_weight_grads_need_a_split_backward_schedule_and_no_fullgraph() -> None:
    """`compile.defer_weight_grads` only means something where a weight pass exists (pp > 1 and a schedule
    that splits backward), and its graph breaks are what `fullgraph` refuses: each error names the keys."""
    defer = {"compile": {"defer_weight_grads": True}}
    pp2 = {**BASE, "mesh": {"pipeline_parallel": 2}, **defer}
    for kind in ("zb1p", "zbv", "dualpipev"):
        assert parse_config({**pp2, "pipelining": {"kind": kind}}).compile.defer_weight_grads
    for kind in ("1f1b", "interleaved_1f1b", "gpipe"):
        with pytest.raises(
            ConfigError, match=rf"compile\.defer_weight_grads with pipelining\.kind={kind}: .*zbv"
        ):
            parse_config({**pp2, "pipelining": {"kind": kind}})
    with pytest.raises(
        ConfigError, match=r"compile\.defer_weight_grads without pipelining .*pipelining\.kind zb1p"
    ):
        parse_config({**BASE, **defer})
    with pytest.raises(ConfigError, match=r"compile\.defer_weight_grads with compile\.fullgraph"):
        parse_config(
            {
                **pp2,
                "pipelining": {"kind": "zbv"},
                "compile": {"defer_weight_grads": True, "fullgraph": True},
            }
        )


def test_deep_ep_needs_bf16_and_a_group_its_kernels_serve_at_config_time() -> None:
    """What DeepEP's intranode kernels take that the config already tells: refused when the job is validated,
    before any process starts (CUDA and the package are checked when the stages are built)."""

    def job(dtype: str, mesh: dict[str, int]) -> dict:
        options = {
            "architecture": ARCH,
            "dtype": dtype,
            "parallel": {"expert_backend": {"kind": "deep_ep"}},
        }
        return {
            **BASE,
            "mesh": mesh,
            "model": {"provider": "qwen3_moe", "options": options},
            "task": {"provider": "causal_lm"},
        }

    parse_config(job("bfloat16", {"data_parallel_shard": 2, "expert_parallel": 2}))
    with pytest.raises(
        ConfigError, match=r"model\.options\.parallel\.expert_backend\.kind 'deep_ep': .*bfloat16 .*'float32'"
    ):
        parse_config(job("float32", {"data_parallel_shard": 2, "expert_parallel": 2}))
    three = {"data_parallel_shard": 3, "expert_parallel": 3}
    with pytest.raises(ConfigError, match=r"groups of \(2, 4, 8\) ranks, got mesh\.expert_parallel = 3"):
        parse_config({**job("bfloat16", three), "batching": {"global_batch_size": 6, "microbatch_size": 2}})


def test_a_wider_grad_dtype_where_fsdp_reduces_once_per_step_needs_the_fsdp_reduce_dtype() -> None:
    """Where FSDP reduces once per step (inside a pipeline step; without one under `fsdp.reduce_every:
    step` with several microbatches) it accumulates the microbatches' gradients in its reduce dtype, where
    `gradient_manager.grad_dtype` does not reach: a float32 grad_dtype over bf16 FSDP-sharded parameters
    would silently accumulate in bf16 (measured under pipelining: 56% of a step's gradient elements differed
    from one process), so the job is refused, naming the key that makes it true. Pipeline steps cannot
    reduce every microbatch: `reduce_every: microbatch` is refused with them."""

    def job(
        mesh: dict[str, int],
        dtype: str = "bfloat16",
        reduce_dtype: str | None = None,
        reduce_every: str = "auto",
        microbatch_size: int = 2,
    ) -> dict:
        fsdp = {"reduce_dtype": reduce_dtype, "reduce_every": reduce_every}
        options = {"architecture": ARCH, "dtype": dtype, "parallel": {"fsdp": fsdp}}
        return {
            **BASE,
            "mesh": mesh,
            "batching": {"global_batch_size": 8, "microbatch_size": microbatch_size},
            "model": {"provider": "qwen3_moe", "options": options},  # FSDP shards its dense parameters
            "task": {"provider": "causal_lm"},
            "gradient_manager": {"grad_dtype": "float32"},
        }

    pp_fsdp = {"pipeline_parallel": 2, "data_parallel_shard": 2}
    with pytest.raises(
        ConfigError,
        match=r"gradient_manager\.grad_dtype 'float32' with FSDP .* mesh\.pipeline_parallel = 2: within a "
        r"pipeline step .*bfloat16 here.* set model\.options\.parallel\.fsdp\.reduce_dtype: float32",
    ):
        parse_config(job(pp_fsdp))
    parse_config(job(pp_fsdp, reduce_dtype="float32"))  # FSDP accumulates in float32 itself
    parse_config(job(pp_fsdp, dtype="float32"))  # nothing wider to ask for
    with pytest.raises(ConfigError, match=r"reduce_every 'microbatch' with mesh\.pipeline_parallel = 2"):
        parse_config(job(pp_fsdp, reduce_dtype="float32", reduce_every="microbatch"))
    fsdp2 = {"data_parallel_shard": 2}
    with pytest.raises(
        ConfigError,
        match=r"fsdp\.reduce_every 'step' \(2 microbatches per step\): within a step .*reduce_dtype: float32",
    ):
        parse_config(job(fsdp2, reduce_every="step"))
    parse_config(job(fsdp2, reduce_every="step", reduce_dtype="float32"))
    parse_config(job(fsdp2, reduce_every="step", microbatch_size=4))  # one microbatch: nothing accumulates
    parse_config(job(fsdp2))  # auto: reduces every microbatch when grad_dtype is wider (d9d.engine.step)
    parse_config(job(fsdp2, reduce_every="microbatch"))
    parse_config(job({"pipeline_parallel": 2, "data_parallel_replicate": 2}))  # no FSDP


def test_trainable_only_needs_the_frozen_weights_from_a_source_checkpoint(tmp_path: Path) -> None:
    """A trainable-only checkpoint leaves the frozen weights out; re-created from a seeded random init they
    differ by device (CUDA and CPU generators) and by layout, so `d9d export` on CPU of a CUDA run would get
    other weights, silently. Refused for the built-in models without a source checkpoint, directly and under
    PEFT; a plug-in's initialization is its own business."""
    from tests.engine_fixtures import make_hf_qwen3

    random_init = {"provider": "qwen3_moe", "options": {"architecture": ARCH}}
    job = {**BASE, "task": {"provider": "causal_lm"}, "checkpointing": {"trainable_only": True}}
    lora = {"kind": "lora", "target_modules": r"q_proj", "rank": 2, "alpha": 4.0}
    with pytest.raises(
        ConfigError, match=r"checkpointing\.trainable_only with model\.options\.source_checkpoint"
    ):
        parse_config({**job, "model": random_init})
    peft = {"provider": "peft", "options": {"base": random_init, "method": lora}}
    with pytest.raises(ConfigError, match=r"model\.options\.base\.options\.source_checkpoint unset"):
        parse_config({**job, "model": peft})
    make_hf_qwen3(tmp_path / "hf")
    from_checkpoint = {"provider": "qwen3", "options": {"source_checkpoint": str(tmp_path / "hf")}}
    parse_config({**job, "model": {"provider": "peft", "options": {"base": from_checkpoint, "method": lora}}})
    parse_config({**job, "task": BASE["task"], "model": BASE["model"]})  # plug-in (TinyLM)
    parse_config({**job, "checkpointing": {}, "model": random_init})  # everything saved


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_a_builtin_model_config_travels_by_reference(family: str) -> None:
    """Ray sends the config to the coordinator and the rank actors by pickling it. The family's section,
    options and provider classes are built at import time; pickled by value they arrived as copies of
    themselves, and pydantic warned on every dump there ("Expected `Qwen3MoeSection`")."""
    import pickle
    import warnings

    from d9d.engine.builtin.models import builtin_provider

    moe_only = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "expert_bias", "router_aux")
    dense = {k: v for k, v in ARCH.items() if not k.startswith(moe_only)}
    architecture = ARCH if family == "qwen3_moe" else dense
    config = parse_config({**BASE, "model": {"provider": family, "options": {"architecture": architecture}}})
    travelled = pickle.loads(pickle.dumps(config))  # plain pickle: only what it can find by name
    assert type(travelled.model) is type(config.model)
    assert type(travelled.model.options) is type(config.model.options)
    assert pickle.loads(pickle.dumps(builtin_provider(family))) is builtin_provider(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert travelled.model_dump() == config.model_dump()
