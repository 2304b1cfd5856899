"""Activation checkpointing as a job setting (`activation_checkpointing:`): none, full, layer-level selective
(`every: k`), op-level selective (`ops: [...]`) and both mixed (`every: k` with `ops`: every k-th layer whole,
the others op-level).

Checked against the run without checkpointing: gradients and MoE statistics bitwise equal in float32 on CPU,
eagerly and inside compiled blocks (aot_eager: the traced graphs without inductor's slow CPU code
generation); the activations a forward leaves alive for backward, measured by tracking every tensor the
forward creates (independent of the checkpoint mechanism and of the dry run's estimate), fall as each mode
says; the dry run's estimate falls accordingly; config validation names the field; a multi-rank engine run
(FSDP 2, pp 2, TP 2 with compiled blocks) trains to the same losses as without checkpointing.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from d9d.engine.config import ConfigError, parse_config
from d9d.engine.dry_run import dry_run
from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from d9d.models.qwen3_moe import Qwen3MoEConfig, Qwen3MoEForCausalLM
from d9d.modules.checkpointing import (
    FullActivationCheckpointing,
    NoActivationCheckpointing,
    SaveOps,
    SelectiveActivationCheckpointing,
    apply_activation_checkpointing,
    plan_layers,
)
from d9d.parallel.compile import CompileConfig, compile_stage
from d9d.pipeline.api import PipelineStageInfo
from tests.engine_fixtures import VOCAB as ENGINE_VOCAB
from tests.harness import RankEnv, run_distributed

CPU = torch.device("cpu")
VOCAB = 64
MODES: dict[str, Any] = {
    "none": NoActivationCheckpointing(),
    "full": FullActivationCheckpointing(),
    "every2": SelectiveActivationCheckpointing(every=2),
    "ops": SelectiveActivationCheckpointing(ops=("matmul", "attention")),
    "mix": SelectiveActivationCheckpointing(every=2, ops=("matmul", "attention")),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _dense(num_layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=num_layers,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        attention_backend="torch",
        loss_chunk_size=16,
    )
    return Qwen3ForCausalLM(config)


def _moe() -> nn.Module:
    torch.manual_seed(0)
    config = Qwen3MoEConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        attention_backend="torch",
        grouped_mm="eager",
        loss_chunk_size=16,
    )
    return Qwen3MoEForCausalLM(config)


MODELS: dict[str, Callable[[], nn.Module]] = {"dense": _dense, "moe": _moe}


def _batch(seq: int = 16, batch: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


@dataclasses.dataclass
class _Step:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def _step(model: nn.Module) -> _Step:
    loss = model(**_batch())["loss"].sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return _Step(loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()})


def _assert_bitwise(got: _Step, want: _Step, what: str) -> None:
    assert torch.equal(got.loss, want.loss), what
    assert got.grads.keys() == want.grads.keys(), what
    for name, grad in want.grads.items():
        assert torch.equal(got.grads[name], grad), f"{what}: {name}"
    for name, buffer in want.buffers.items():  # MoE load statistics: counted once, not again in recompute
        assert torch.equal(got.buffers[name], buffer), f"{what}: {name}"


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_eager_gradients_equal_without_checkpointing(model: str) -> None:
    want = _step(MODELS[model]())
    for mode, config in MODES.items():
        checkpointed = MODELS[model]()
        assert apply_activation_checkpointing(checkpointed, config) == 1
        _assert_bitwise(_step(checkpointed), want, f"{model} {mode}")


@pytest.mark.parametrize(("model", "modes"), [("dense", ("every2", "ops", "mix")), ("moe", ("ops", "mix"))])
def test_compiled_blocks_gradients_equal_without_checkpointing(model: str, modes: tuple[str, ...]) -> None:
    """Whole-layer checkpointing around the compiled block call (every k-th layer is the same call), the
    op-level policy traced inside the block's compiled function (an MoE layer's load statistics are a
    forward side effect there), both in one stack when mixed; no fallback to eager, no graph break in the
    dense blocks, and no graph per layer: a mixed stack compiles the whole-layer form's graph and the
    op-level form's, once each."""
    want = _step(MODELS[model]())
    graphs = {}
    for mode in modes:
        torch._dynamo.reset()
        counters.clear()
        compiled = MODELS[model]()
        apply_activation_checkpointing(compiled, MODES[mode])
        report = compile_stage(compiled, CompileConfig(enabled=True, backend="aot_eager"), CPU)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a compile failure warns and runs eager
            _assert_bitwise(_step(compiled), want, f"compiled {model} {mode}")
        assert report.stats.failure is None and report.stats.graphs >= 1, (mode, report.stats)
        graphs[mode] = report.stats.graphs
        if model == "dense":
            expected = 2 if mode == "mix" else 1  # the plain block's function and the checkpointed one's
            assert report.stats.graphs == expected and not counters["graph_break"], (mode, report.stats)
            assert not counters["recompiles"], (mode, dict(counters["recompiles"]))
    if model == "dense":
        assert graphs["mix"] == graphs["every2"] + graphs["ops"], graphs


@pytest.mark.gpu
def test_cuda_inductor_blocks_with_each_mode_match_eager() -> None:
    """Inductor on CUDA (the `auto` attention backend: SDPA is_causal, FlexAttention for documents) with
    every mode: loss and gradients against the eager model without checkpointing, no fallback."""
    device = torch.device("cuda")
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        num_layers=4,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=256,
        attention_backend="auto",
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 257), generator=g).to(device)
    documents = torch.arange(256, device=device).div(64, rounding_mode="floor").expand(4, 256)

    def step(model: nn.Module, **extra: torch.Tensor) -> _Step:
        loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:], **extra)["loss"].sum()
        loss.backward()
        return _Step(
            loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, {}
        )

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Qwen3ForCausalLM(config).to(device)

    for extra in ({}, {"segment_ids": documents}):
        want = step(build(), **extra)
        for mode, checkpointing in MODES.items():
            torch._dynamo.reset()
            model = build()
            apply_activation_checkpointing(model, checkpointing)
            report = compile_stage(model, CompileConfig(), device)
            got = step(model, **extra)
            torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-4)
            for name, grad in want.grads.items():
                torch.testing.assert_close(got.grads[name], grad, rtol=1e-3, atol=1e-4, msg=f"{mode} {name}")
            assert report.stats.failure is None, (mode, report.stats)


def _saved_by_autograd(model: nn.Module) -> int:
    """Bytes autograd packs for backward during one forward (inside a checkpoint its own hooks take them)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**_batch())["loss"].sum()
    return total


def test_compiled_op_policy_keeps_less_than_the_compiled_block() -> None:
    """The policy reaches the compiled graph: its saved tensors shrink to the inputs and the matmul and
    attention outputs (measured with autograd's saved-tensor hooks, which see the compiled function's); mixed
    with whole-layer checkpointing of every second layer, they shrink further, still above full's."""
    saved = {}
    for mode in ("none", "ops", "mix"):
        torch._dynamo.reset()
        model = _dense()
        apply_activation_checkpointing(model, MODES[mode])
        compile_stage(model, CompileConfig(enabled=True, backend="aot_eager"), CPU)
        saved[mode] = _saved_by_autograd(model)
    eager = _dense()
    apply_activation_checkpointing(eager, MODES["full"])
    assert _saved_by_autograd(eager) < saved["mix"] < saved["ops"] < saved["none"], saved


class _TrackOutputs(TorchDispatchMode):
    """Records the storage of every tensor an op creates (below autograd and checkpointing); after the
    forward, those still alive are what is kept for backward. Optionally sums, separately, the outputs of
    ops named in `watched` while `inside` is set (one decoder layer running)."""

    def __init__(self, watched: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []
        self.watched = watched
        self.inside = False
        self.watched_bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.refs.append((StorageWeakRef(storage), storage.nbytes()))
                if self.inside and func.name() in self.watched:
                    self.watched_bytes += storage.nbytes()
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        gc.collect()
        live = {ref.cdata: n for ref, n in self.refs if not ref.expired() and ref.cdata not in exclude}
        return sum(live.values())


def _kept_bytes(model: nn.Module) -> int:
    existing = {StorageWeakRef(t.untyped_storage()).cdata for t in [*model.parameters(), *model.buffers()]}
    batch = _batch(seq=32)
    with _TrackOutputs() as track:
        out = model(**batch)["loss"].sum()
    kept = track.live_bytes(existing)
    out.backward()  # frees what was kept
    return kept


def test_saved_activations_fall_as_each_mode_says() -> None:
    """Four identical layers: full keeps only the layer boundaries (C); none keeps C + 4·X (X: one layer's
    internals); every 2 checkpoints two layers, C + 2·X; ops keeps C plus every layer's matmul and attention
    outputs (summed from a plain forward); mixed keeps C plus those outputs of the two op-level layers."""
    kept = {}
    for mode, config in MODES.items():
        model = _dense()
        apply_activation_checkpointing(model, config)
        kept[mode] = _kept_bytes(model)
    assert kept["full"] < kept["every2"] < kept["none"] and kept["full"] < kept["ops"] < kept["none"], kept
    assert 2 * kept["every2"] == kept["none"] + kept["full"], kept

    plain = _dense()
    watched = frozenset({"aten::mm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu"})
    track = _TrackOutputs(watched)

    def enter(*_: Any) -> None:
        track.inside = True

    def leave(*_: Any) -> None:
        track.inside = False

    for layer in plain.model.decoder_layers().values():
        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    with track:
        plain(**_batch(seq=32))
    assert track.watched_bytes > 0
    assert kept["ops"] == kept["full"] + track.watched_bytes, (kept, track.watched_bytes)
    # layers 0 and 2 whole, 1 and 3 op-level: half of the (identical) layers' op outputs
    assert 2 * kept["mix"] == 2 * kept["full"] + track.watched_bytes, (kept, track.watched_bytes)
    assert kept["full"] < kept["mix"] < kept["ops"] and kept["mix"] < kept["every2"], kept


def test_layers_are_chosen_by_global_index_on_every_stage() -> None:
    config = SelectiveActivationCheckpointing(every=2)
    assert plan_layers(config, range(6)) == dict.fromkeys([0, 2, 4])
    torch.manual_seed(0)
    stage = Qwen3ForCausalLM(_dense(6).config, PipelineStageInfo(1, 2))  # type: ignore[arg-type]
    apply_activation_checkpointing(stage, config)
    assert stage.model.checkpointed_layers == {4: None}  # holds layers 3, 4, 5
    apply_activation_checkpointing(stage, NoActivationCheckpointing())
    assert stage.model.checkpointed_layers == {}
    apply_activation_checkpointing(stage, MODES["ops"])
    assert set(stage.model.checkpointed_layers) == {3, 4, 5}
    assert all(
        p is not None and p.kinds == {"matmul", "attention"} for p in stage.model.checkpointed_layers.values()
    )


def test_mixed_plan_recomputes_every_kth_layer_whole_and_the_rest_op_level() -> None:
    ops = SaveOps(frozenset({"matmul", "attention"}))
    assert plan_layers(MODES["mix"], range(6)) == {0: None, 1: ops, 2: None, 3: ops, 4: None, 5: ops}
    every3 = SelectiveActivationCheckpointing(every=3, ops=("attention",))
    attention = SaveOps(frozenset({"attention"}))
    assert plan_layers(every3, range(3, 7)) == {3: None, 4: attention, 5: attention, 6: None}
    torch.manual_seed(0)
    stage = Qwen3ForCausalLM(_dense(6).config, PipelineStageInfo(1, 2))  # type: ignore[arg-type]
    apply_activation_checkpointing(stage, MODES["mix"])
    assert stage.model.checkpointed_layers == {3: ops, 4: None, 5: ops}  # global indices: 4 is whole


# -- config validation and the dry run --------------------------------------------------------------------

ARCH = {
    "vocab_size": 259,
    "hidden_size": 32,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
}


def _job(tmp: Path, checkpointing: Any = None, **sections: Any) -> dict[str, Any]:
    corpus = tmp / "corpus.txt"
    corpus.write_text("a few words\nand some more\n")
    job = {
        "run": {"name": "ac", "dir": str(tmp / "run")},
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 5},
        "model": {"provider": "qwen3", "options": {"architecture": ARCH}},
        "data": {"provider": "text", "options": {"dataset": {"paths": [str(corpus)], "max_length": 64}}},
        **sections,
    }
    if checkpointing is not None:
        job["activation_checkpointing"] = checkpointing
    return job


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"mode": "some"}, r"activation_checkpointing: Input tag 'some' found using 'mode' does not match"),
        ({"mode": "selective", "every": 0}, r"activation_checkpointing\.every: Input should be greater than"),
        ({"mode": "selective"}, r"activation_checkpointing: .*takes `every: k`.*or both"),
        (
            {"mode": "selective", "every": 2, "ops": ["conv"]},
            r"activation_checkpointing\.ops\.0: Input should be 'matmul'",
        ),
        ({"mode": "selective", "every": 0, "ops": ["matmul"]}, r"activation_checkpointing\.every: "),
        (
            {"mode": "selective", "ops": ["conv"]},
            r"activation_checkpointing\.ops\.0: Input should be 'matmul'",
        ),
        ({"mode": "selective", "ops": []}, r"activation_checkpointing\.ops: .*at least 1 item"),
        ({"mode": "selective", "ops": ["matmul", "matmul"]}, r"names an op kind twice"),
        ({"mode": "full", "every": 2}, r"activation_checkpointing\.every: Extra inputs are not permitted"),
    ],
)
def test_bad_sections_name_the_field(tmp_path: Path, section: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(_job(tmp_path, section))


def test_the_default_is_none_and_every_mode_parses(tmp_path: Path) -> None:
    assert parse_config(_job(tmp_path)).activation_checkpointing == NoActivationCheckpointing()
    for config in MODES.values():
        assert parse_config(_job(tmp_path, config.model_dump())).activation_checkpointing == config


def test_a_family_without_a_decoder_stack_is_refused_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path, {"mode": "full"})
    options = type(parse_config(job).model.options)  # the qwen3 provider's options: they name the family
    monkeypatch.setattr(
        options, "family", dataclasses.replace(options.family, activation_checkpointing=False)
    )
    with pytest.raises(
        ConfigError, match=r"activation_checkpointing\.mode=full: model\.provider is the 'qwen3'"
    ):
        parse_config(job)
    parse_config(_job(tmp_path, {"mode": "none"}))  # nothing to refuse without checkpointing


def test_op_level_under_compile_with_expert_parallelism_is_refused(tmp_path: Path) -> None:
    """At config time with compile.enabled; when the stages are built where compilation is on by default.
    Mixed with `every: k` too: its other layers are op-level; the remedy is to remove `ops`."""
    from d9d.core.mesh_params import DeviceMeshParameters
    from d9d.engine.parallel_checks import check_op_checkpointing_compiled

    moe = {**ARCH, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}
    job = _job(
        tmp_path,
        {"mode": "selective", "ops": ["matmul"]},
        mesh={"data_parallel_shard": 2, "expert_parallel": 2},
        model={"provider": "qwen3_moe", "options": {"architecture": moe}},
        compile={"enabled": True},
    )
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.ops with mesh\.expert_parallel = 2"):
        parse_config(job)
    mixed = {"mode": "selective", "every": 2, "ops": ["matmul"]}
    with pytest.raises(
        ConfigError,
        match=r"activation_checkpointing\.ops with mesh\.expert_parallel = 2.*remove "
        r"activation_checkpointing `ops` \(`every: k` alone",
    ):
        parse_config({**job, "activation_checkpointing": mixed})
    parse_config({**job, "compile": {"enabled": False}})
    parse_config({**job, "compile": {}})  # null: decided by the device, when the stages are built
    parse_config({**job, "activation_checkpointing": {"mode": "selective", "every": 2}})
    for mode in ("ops", "mix"):
        with pytest.raises(ValueError, match="all-to-all breaks"):
            check_op_checkpointing_compiled(
                DeviceMeshParameters(data_parallel_shard=2, expert_parallel=2), MODES[mode]
            )


def test_op_level_with_a_split_backward_schedule_is_refused(tmp_path: Path) -> None:
    """torch's selective checkpointing allows one backward per region; zero-bubble schedules run two. Mixed
    with `every: k` too (its other layers are op-level): the remedy is to remove `ops`."""
    job = _job(
        tmp_path,
        {"mode": "selective", "ops": ["matmul"]},
        mesh={"pipeline_parallel": 2},
        pipelining={"kind": "zb1p"},
    )
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.ops with pipelining\.kind=zb1p"):
        parse_config(job)
    mixed = {"mode": "selective", "every": 2, "ops": ["matmul"]}
    with pytest.raises(
        ConfigError, match=r"activation_checkpointing\.ops with pipelining\.kind=zb1p.*remove `ops`"
    ):
        parse_config({**job, "activation_checkpointing": mixed})
    parse_config({**job, "activation_checkpointing": {"mode": "selective", "every": 2}})
    parse_config({**job, "pipelining": {"kind": "1f1b"}})
    parse_config({**job, "activation_checkpointing": {"mode": "full"}})


def test_a_stage_without_a_decoder_stack_is_refused_when_built() -> None:
    from d9d.engine.stages import apply_stage_checkpointing
    from tests.engine_fixtures import TinyLM

    module = TinyLM(4)
    apply_stage_checkpointing(module, NoActivationCheckpointing(), PipelineStageInfo())
    with pytest.raises(
        ConfigError, match=r"activation_checkpointing\.mode=full: stage 0 of the model \(TinyLM\)"
    ):
        apply_stage_checkpointing(module, FullActivationCheckpointing(), PipelineStageInfo())


def test_dry_run_estimate_falls_with_checkpointing(tmp_path: Path) -> None:
    """4 layers × 2 × 64 tokens in float32: without checkpointing Σ(8h + 3f) per layer; full keeps h per
    layer plus one layer's recompute; every 2 two layers of each; ops the input and the matmul/attention
    outputs per layer plus one layer's recompute; mixed (every 2 with ops) the input of layers 0 and 2, the
    input and those outputs of layers 1 and 3, plus one layer's recompute (a whole-layer one's: the
    larger)."""
    estimates = {}
    notes = {}
    for mode, config in MODES.items():
        (memory,) = dry_run(parse_config(_job(tmp_path, config.model_dump()))).memory
        assert memory.activations is not None
        estimates[mode] = memory.activations
        notes[mode] = "\n".join(memory.notes)
    h, f, q, kv = 32, 48, 32, 16
    tokens, size = 2 * 64, 4
    layer = 8 * h + 3 * f
    ops = h + (q + 2 * kv) + q + h + 2 * f + h
    base = min(2048, tokens) * 259 * 4  # one fp32 loss chunk (loss_chunk_size 2048 ≥ the tokens)
    assert estimates["none"] == base + tokens * 4 * layer * size
    assert estimates["full"] == base + tokens * (4 * h + layer - h) * size
    assert estimates["every2"] == base + tokens * (2 * layer + 2 * h + layer - h) * size
    assert estimates["ops"] == base + tokens * (4 * ops + layer - ops) * size
    assert estimates["mix"] == base + tokens * (2 * h + 2 * ops + layer - h) * size
    assert estimates["full"] < estimates["every2"] < estimates["none"]
    assert estimates["ops"] < estimates["none"]
    assert estimates["full"] < estimates["mix"] < estimates["ops"] and estimates["mix"] < estimates["every2"]
    assert "checkpoint" not in notes["none"]
    assert "activation_checkpointing full: each of the 4 checkpointed layer(s)" in notes["full"]
    assert "selective every 2: each of the 2 checkpointed layer(s)" in notes["every2"]
    assert (
        "selective ops ['matmul', 'attention']" in notes["ops"] and "matmul/attention outputs" in notes["ops"]
    )
    assert (
        "selective every 2 + ops ['matmul', 'attention']: of the 4 checkpointed layer(s) here, the 2 "
        "whole-layer one(s) keep their input (hidden), the 2 op-level one(s) their input and "
        "matmul/attention outputs" in notes["mix"]
    )


# -- through the engine, multi-rank -----------------------------------------------------------------------


def _engine_config(
    tmp: Path, name: str, layout: dict[str, Any], checkpointing: dict[str, Any], moe: bool
) -> dict[str, Any]:
    return {
        "run": {"name": name, "dir": str(tmp / name)},
        "batching": {"global_batch_size": 4, "microbatch_size": 2},
        "trainer": {"total_steps": 2},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"save_at_end": False},
        # random init, seeded per stage: the same weights with and without checkpointing in one layout
        "model": {
            "provider": "qwen3_moe" if moe else "qwen3",
            "options": {"architecture": ENGINE_MOE if moe else ENGINE_DENSE},
        },
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
        "activation_checkpointing": checkpointing,
        **layout,
    }


ENGINE_DENSE = {**ARCH, "vocab_size": ENGINE_VOCAB}
ENGINE_MOE = {
    **ENGINE_DENSE,
    "num_layers": 2,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}
OPS = {"mode": "selective", "ops": ["matmul", "attention"]}
# (name, mesh and schedule, MoE model, modes: the first without checkpointing). Compiled blocks under FSDP /
# TP / EP are covered in tests/test_parallel_compile.py (a compiled engine run costs ~15 s of tracing on CPU).
ENGINE_RUNS: list[tuple[str, dict[str, Any], bool, list[dict[str, Any]]]] = [
    ("fsdp", {"mesh": {"data_parallel_shard": 2}}, False, [{"mode": "none"}, {"mode": "full"}, OPS]),
    (  # mixed: each stage holds whole-layer and op-level layers (global indices)
        "pp",
        {"mesh": {"pipeline_parallel": 2}},
        False,
        [{"mode": "none"}, {"mode": "selective", "every": 2}, {**OPS, "every": 2}],
    ),
    (  # zero-bubble: the input and weight passes are two backward calls through the checkpointed layers
        "pp-zbv",
        {
            "mesh": {"pipeline_parallel": 2},
            "pipelining": {"kind": "zbv"},
            "batching": {"global_batch_size": 8, "microbatch_size": 2},
            "model": {"provider": "qwen3", "options": {"architecture": {**ENGINE_DENSE, "num_layers": 6}}},
        },
        False,
        [{"mode": "none"}, {"mode": "full"}],  # op-level is refused with split backward
    ),
    ("cp", {"mesh": {"context_parallel_shard": 2}}, False, [{"mode": "none"}, {"mode": "full"}]),
    ("tp", {"mesh": {"tensor_parallel": 2}}, False, [{"mode": "none"}, OPS]),
    ("ep", {"mesh": {"data_parallel_shard": 2, "expert_parallel": 2}}, True, [{"mode": "none"}, OPS]),
]


def _engine_runs(env: RankEnv) -> None:
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.launch import run_rank
    from d9d.engine.runtime import RankRuntime

    for layout, mesh, moe, modes in ENGINE_RUNS:
        for i, checkpointing in enumerate(modes):
            config = parse_config(_engine_config(env.tmp_dir, f"{layout}-{i}", mesh, checkpointing, moe))
            runtime = RankRuntime(
                rank=env.rank, world_size=env.world_size, local_rank=env.rank, run_dir=config.run_dir
            )
            result = run_rank(config, runtime, LocalRunReporter(config.checkpoint_dir, 1))
            if env.rank == 0:
                torch.save(list(result.losses), env.tmp_dir / f"{layout}-{i}.pt")


@pytest.mark.distributed
def test_engine_losses_equal_without_checkpointing_under_every_layout(tmp_path: Path) -> None:
    """Two ranks, two steps each of FSDP, pp (1F1B and ZBV), cp, tp and ep (MoE): every checkpointing mode
    trains to exactly the losses of the same layout without it."""
    run_distributed(_engine_runs, 2, tmp_dir=tmp_path, timeout=300)
    for layout, _mesh, _moe, modes in ENGINE_RUNS:
        want = torch.load(tmp_path / f"{layout}-0.pt")
        assert len(want) == 2
        for i, checkpointing in enumerate(modes[1:], start=1):
            assert torch.load(tmp_path / f"{layout}-{i}.pt") == want, (layout, checkpointing)
