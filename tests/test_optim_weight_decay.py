"""Weight-decay exemptions of the built-in optimizers (`optimizer.options.no_weight_decay`,
`no_weight_decay_1d`; docs/optim.md): the param groups, the names they are chosen by, the pattern check,
loading state, the LR schedule over both groups, and the run identity of a job without them."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from d9d.engine.builtin.optimizers import AdamWProvider, SGDProvider, StochasticAdamWProvider
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.identity import run_identity
from d9d.engine.registry import build_model
from d9d.engine.train_parts import _stage_optimizer
from d9d.optim import PiecewiseScheduleConfig, StochasticAdamW, build_piecewise_lr
from d9d.optim.param_groups import parameter_name

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
LR, WD = 0.05, 0.2


class Tiny(nn.Module):
    """Named like a language model's parts: an embedding, a norm, a projection with a bias, a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(6, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4, bias=False)
        self.frozen.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.frozen(self.proj(self.norm(self.embed(tokens))))
        return out


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 6, (3, 5), generator=torch.Generator().manual_seed(step))
    out: torch.Tensor = model(tokens)
    return out.pow(2).mean()


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        _loss(model, step).backward()  # type: ignore[no-untyped-call]
        optimizer.step()


PROVIDERS: dict[str, Any] = {
    "adamw": (AdamWProvider, {"lr": LR, "weight_decay": WD, "betas": (0.8, 0.9), "eps": 1e-6}),
    "sgd": (SGDProvider, {"lr": LR, "weight_decay": WD, "momentum": 0.9, "nesterov": True}),
    "stochastic_adamw": (
        StochasticAdamWProvider,
        {"lr": LR, "weight_decay": WD, "betas": (0.8, 0.9), "eps": 1e-6, "backend": "torch"},
    ),
}


def _reference(kind: str, groups: list[dict[str, Any]], seed: int) -> torch.optim.Optimizer:
    """The torch (or d9d) optimizer built by hand with explicit groups: what the provider must build."""
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=LR, betas=(0.8, 0.9), eps=1e-6, weight_decay=WD)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=LR, momentum=0.9, weight_decay=WD, nesterov=True)
    return StochasticAdamW(
        groups, lr=LR, betas=(0.8, 0.9), eps=1e-6, weight_decay=WD, seed=seed, backend="torch"
    )


def _provider(kind: str, **exemptions: Any) -> Any:
    cls, options = PROVIDERS[kind]
    return cls(cls.Config(**options, **exemptions))


@pytest.mark.parametrize("kind", list(PROVIDERS))
def test_exemptions_train_like_hand_built_param_groups(kind: str) -> None:
    """`no_weight_decay` (a name pattern) and `no_weight_decay_1d` give the decayed group and the exempt one
    (weight_decay 0), each in parameter order; 4 steps equal the hand-built optimizer bit for bit."""
    model, twin = Tiny(), Tiny()
    ours = _provider(kind, no_weight_decay=[r"embed\.weight"], no_weight_decay_1d=True).build(
        model.named_parameters(), seed=7
    )
    reference = _reference(
        kind,
        [
            {"params": [twin.proj.weight]},
            {
                "params": [twin.embed.weight, twin.norm.weight, twin.norm.bias, twin.proj.bias],
                "weight_decay": 0,
            },
        ],
        seed=7,
    )
    names = {id(p): n for n, p in model.named_parameters()}
    assert [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in ours.param_groups] == [
        (["proj.weight"], WD),
        (["embed.weight", "norm.weight", "norm.bias", "proj.bias"], 0.0),
    ]
    _train(model, ours, range(4))
    _train(twin, reference, range(4))
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("kind", list(PROVIDERS))
def test_without_exemptions_every_trainable_parameter_is_in_one_decayed_group(kind: str) -> None:
    """The default is unchanged: one group, every trainable parameter decayed, in module order."""
    model = Tiny()
    optimizer = _provider(kind).build(model.named_parameters(), seed=7)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(optimizer.param_groups) == 1
    assert optimizer.param_groups[0]["params"] == trainable
    assert optimizer.param_groups[0]["weight_decay"] == WD


def test_exempt_parameters_are_not_decayed() -> None:
    """With zero gradients AdamW's step is the decay alone: the exempt parameters stay put to the bit, the
    others shrink by exactly (1 - lr·wd)."""
    model = Tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = _provider("adamw", no_weight_decay=[r"norm\..*"]).build(model.named_parameters(), seed=0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        if name.startswith("norm.") or name.startswith("frozen."):
            assert torch.equal(p, before[name]), name
        else:
            assert torch.equal(p, before[name] * (1 - LR * WD)), name


def test_a_group_without_parameters_is_left_out() -> None:
    model = Tiny()
    only_2d = _provider("adamw", no_weight_decay=[r"proj\.weight", r"embed\.weight"]).build(
        [(n, p) for n, p in model.named_parameters() if p.ndim == 2], seed=0
    )
    assert [g["weight_decay"] for g in only_2d.param_groups] == [0.0]
    only_1d = _provider("adamw", no_weight_decay_1d=True).build(
        [(n, p) for n, p in model.named_parameters() if p.ndim == 2], seed=0
    )
    assert [g["weight_decay"] for g in only_1d.param_groups] == [WD]


class _Recording:
    """An optimizer provider that keeps the names it was given."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def build(self, named_parameters: Any, *, seed: int) -> torch.optim.Optimizer:
        named = list(named_parameters)
        self.names = [n for n, _ in named]
        return torch.optim.SGD([p for _, p in named if p.requires_grad], lr=0.1)


def _wrapped() -> nn.Module:
    """Tiny with an activation-checkpoint wrapper around `norm` and `proj`, the whole compiled."""
    model = Tiny()
    model.norm = checkpoint_wrapper(model.norm)  # type: ignore[assignment]
    model.proj = checkpoint_wrapper(model.proj)  # type: ignore[assignment]
    return torch.compile(model)  # type: ignore[return-value]  # an OptimizedModule: `_orig_mod.` names


def test_the_engine_names_parameters_as_the_state_dict_does_through_wrappers() -> None:
    """Activation-checkpoint and compile wrappers insert segments into `named_parameters()` names; the
    engine hands providers the state-dict names (what patterns are written against)."""
    wrapped = _wrapped()
    raw = [n for n, _ in wrapped.named_parameters()]
    assert "_orig_mod.norm._checkpoint_wrapped_module.weight" in raw
    recording = _Recording()
    _stage_optimizer(recording, wrapped, seed=0, device=torch.device("cpu"))
    plain = [n for n, _ in Tiny().named_parameters()]
    assert recording.names == plain
    assert recording.names == [k for k in Tiny().state_dict() if k in plain]
    assert [parameter_name(n) for n in raw] == plain

    optimizer = _stage_optimizer(
        _provider("adamw", no_weight_decay=[r"norm\.weight", r"proj\.bias"]),
        wrapped,
        seed=0,
        device=torch.device("cpu"),
    )
    inner: Any = wrapped._orig_mod
    exempt = optimizer.param_groups[1]
    assert exempt["weight_decay"] == 0.0
    assert exempt["params"] == [
        inner.norm._checkpoint_wrapped_module.weight,
        inner.proj._checkpoint_wrapped_module.bias,
    ]


def test_a_stage_without_trainable_parameters_gets_empty_groups() -> None:
    frozen = Tiny().requires_grad_(False)
    optimizer = _stage_optimizer(
        _provider("adamw", no_weight_decay_1d=True), frozen, seed=0, device=torch.device("cpu")
    )
    assert [g["params"] for g in optimizer.param_groups] == [[]]
    assert not optimizer.state


def test_loaded_state_keeps_the_configured_weight_decay() -> None:
    """torch takes each group's hyperparameters from a loaded state (DCP's flattened form: from the group's
    first parameter), so a state saved without exemptions would bring weight_decay 0.2 back to the exempt
    group; the configured values win."""
    model = Tiny()
    saved_by = _provider("adamw").build(model.named_parameters(), seed=0)
    _train(model, saved_by, range(2))
    state: dict[str, Any] = get_optimizer_state_dict(model, saved_by, options=FLAT)
    assert state["param_groups.norm.weight.weight_decay"] == WD
    resumed = copy.deepcopy(model)  # without gradients, as a model that was just built
    loading = _provider("adamw", no_weight_decay_1d=True).build(resumed.named_parameters(), seed=0)
    set_optimizer_state_dict(resumed, loading, state, options=FLAT)
    assert [g["weight_decay"] for g in loading.param_groups] == [WD, 0.0]
    moments = loading.state[resumed.norm.weight]["exp_avg"]
    assert torch.equal(moments, saved_by.state[model.norm.weight]["exp_avg"])


@pytest.mark.parametrize("kind", list(PROVIDERS))
def test_state_round_trip_through_dcp_resumes_bitwise(kind: str) -> None:
    """2 steps, the flattened (DCP) optimizer state saved, loaded into a fresh optimizer over a copy of the
    model, 2 more steps: equal to 4 straight steps."""
    model = Tiny()
    exemptions = {"no_weight_decay": [r"embed\.weight"], "no_weight_decay_1d": True}
    optimizer = _provider(kind, **exemptions).build(model.named_parameters(), seed=3)
    _train(model, optimizer, range(2))
    resumed = copy.deepcopy(model)
    state = copy.deepcopy(get_optimizer_state_dict(model, optimizer, options=FLAT))
    _train(model, optimizer, range(2, 4))
    fresh = _provider(kind, **exemptions).build(resumed.named_parameters(), seed=3)
    set_optimizer_state_dict(resumed, fresh, state, options=FLAT)
    _train(resumed, fresh, range(2, 4))
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name


# -- the LR schedule ----------------------------------------------------------------------------------------

SCHEDULE = PiecewiseScheduleConfig.model_validate(
    {
        "initial_multiplier": 0.0,
        "phases": [
            {"kind": "steps", "steps": 2, "target": 1.0, "curve": {"type": "linear"}},
            {"kind": "rest", "target": 0.1, "curve": {"type": "cosine"}},
        ],
    }
)


def test_the_schedule_scales_both_groups() -> None:
    model = Tiny()
    optimizer = _provider("adamw", no_weight_decay_1d=True).build(model.named_parameters(), seed=0)
    scheduler = build_piecewise_lr(SCHEDULE, optimizer, total_steps=6)
    for step in range(5):
        multiplier = SCHEDULE.resolve(6).multiplier(step)
        assert [g["lr"] for g in optimizer.param_groups] == [LR * multiplier] * 2, step
        _train(model, optimizer, range(step, step + 1))
        scheduler.step()


def test_one_schedule_state_restores_stages_with_other_group_counts() -> None:
    """Under pipelining one saved scheduler state restores every stage (the engine keeps rank 0's), and a
    stage may hold one group where another holds two (an exemption matching on one stage only): equal base
    LRs are saved once and fit both."""
    two = _provider("adamw", no_weight_decay_1d=True).build(Tiny().named_parameters(), seed=0)
    one = _provider("adamw").build(Tiny().named_parameters(), seed=0)
    two_scheduler = build_piecewise_lr(SCHEDULE, two, total_steps=6)
    for _ in range(3):
        two.step()
        two_scheduler.step()
    state = two_scheduler.state_dict()
    assert state["base_lrs"] == [LR]
    one_scheduler = build_piecewise_lr(SCHEDULE, one, total_steps=6)
    one_scheduler.load_state_dict(state)
    assert [g["lr"] for g in one.param_groups] == [two.param_groups[0]["lr"]]
    again = build_piecewise_lr(
        SCHEDULE,
        _provider("adamw", no_weight_decay_1d=True).build(Tiny().named_parameters(), seed=0),
        total_steps=6,
    )
    again.load_state_dict(one_scheduler.state_dict())
    assert [g["lr"] for g in again.optimizer.param_groups] == [two.param_groups[0]["lr"]] * 2
    assert again.base_lrs == [LR, LR]


def test_different_base_lrs_do_not_load_into_another_group_count() -> None:
    model = Tiny()
    groups = [{"params": [model.proj.weight], "lr": 0.1}, {"params": [model.proj.bias], "lr": 0.2}]
    scheduler = build_piecewise_lr(SCHEDULE, torch.optim.SGD(groups, lr=0.1), total_steps=6)
    other = build_piecewise_lr(SCHEDULE, torch.optim.SGD([model.norm.weight], lr=0.1), total_steps=6)
    with pytest.raises(ValueError, match="PiecewiseLR state has 2 different base LRs, the optimizer has 1"):
        other.load_state_dict(scheduler.state_dict())


# -- config ----------------------------------------------------------------------------------------------


def _job(tmp: Path, optimizer: dict[str, Any], **sections: Any) -> dict[str, Any]:
    return {
        "run": {"name": "wd", "dir": str(tmp / "run")},
        "batching": {"global_batch_size": 4, "microbatch_size": 1},
        "trainer": {"total_steps": 4},
        "model": {"provider": "qwen3", "options": {"architecture": ARCH}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": optimizer,
        **sections,
    }


ARCH = {
    "vocab_size": 32,
    "hidden_size": 32,
    "num_layers": 4,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "tie_word_embeddings": False,
}


def test_a_job_without_exemptions_keeps_its_run_identity(tmp_path: Path) -> None:
    """The options are left out of the run identity at their defaults, so commits of runs from before they
    existed still resume; set, they are part of it (a resume that changes them is refused, listing them)."""
    plain = run_identity(parse_config(_job(tmp_path, {"provider": "adamw"})))
    assert not [k for k in plain.values if "no_weight_decay" in k]
    explicit_defaults = {"provider": "adamw", "options": {"no_weight_decay": [], "no_weight_decay_1d": False}}
    assert run_identity(parse_config(_job(tmp_path, explicit_defaults))).fingerprint == plain.fingerprint
    exempt = {"provider": "adamw", "options": {"no_weight_decay": ["model\\.norm\\.weight"]}}
    assert plain.differences(run_identity(parse_config(_job(tmp_path, exempt)))) == [
        'optimizer.options.no_weight_decay: "<unset>" -> ["model\\\\.norm\\\\.weight"]'
    ]


@pytest.mark.parametrize("provider", ["adamw", "sgd", "stochastic_adamw"])
def test_an_invalid_pattern_is_refused_at_config_time(tmp_path: Path, provider: str) -> None:
    bad = {"provider": provider, "options": {"no_weight_decay": [r"model\.norm\.weight", "(unclosed"]}}
    with pytest.raises(ConfigError, match=re.escape("no_weight_decay[1] '(unclosed' is not a regular")):
        parse_config(_job(tmp_path, bad))


def test_a_pattern_matching_no_parameter_of_any_stage_is_refused(tmp_path: Path) -> None:
    """Each pattern must match a parameter of the whole model: under pipelining one stage sees only its
    own parameters, so `model\\.norm\\.weight` (last stage) and the embedding (first) are fine, and a typo
    is refused naming its key, with the closest names."""
    model = build_model(parse_config(_job(tmp_path, {"provider": "adamw"})).model)
    good = _provider("adamw", no_weight_decay=[r"model\.norm\.weight", r"model\.embed_tokens\..*"])
    for stages in (1, 2, 3):
        good.check_model(model, stages)
    typo = _provider("adamw", no_weight_decay=[r"model\.norm\.weight", r"model\.embed_tokens\.weight"])
    expected = (
        "optimizer.options.no_weight_decay[1] 'model\\\\.embed_tokens\\\\.weight' fully matches no parameter "
        "of the model (re.fullmatch against 47 parameter names; closest: model.embed_tokens.weights.regular"
    )
    for stages in (1, 2):
        with pytest.raises(ValueError, match=re.escape(expected)):
            typo.check_model(model, stages)


# -- the engine: pipeline stages and FSDP, resume ------------------------------------------------------------

STEPS, STOP = 6, 3
ENGINE_LAYOUTS: dict[str, tuple[dict[str, int], dict[str, str] | None, dict[str, Any]]] = {
    # the embedding is on the first stage only: the second stage has no exempt group (one group, the first
    # two), and every rank restores its LR scheduler from rank 0's saved state
    "pp2": ({"pipeline_parallel": 2}, {"kind": "1f1b"}, {"no_weight_decay": [r"model\.embed_tokens\..*"]}),
    # FSDP-sharded parameters (DTensors) keep their names and their full shape's dimensions
    "fsdp2": (
        {"data_parallel_shard": 2},
        None,
        {"no_weight_decay": [r"lm_head\..*"], "no_weight_decay_1d": True},
    ),
}


def _engine_job(tmp: Path, name: str, layout: str, total: int, **options: Any) -> dict[str, Any]:
    mesh, schedule, exemptions = ENGINE_LAYOUTS[layout]
    return {
        "run": {"name": name, "dir": str(tmp / name)},
        "mesh": mesh,
        "pipelining": schedule,
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": total},
        "logging": {"progress_bar": "off", "period": 1},
        "checkpointing": {"period": STOP, "save_at_end": False},
        "model": {"provider": "qwen3", "options": {"source_checkpoint": str(tmp / "hf")}},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {
            "provider": "adamw",
            "options": {"lr": 2e-2, "weight_decay": 0.5, **exemptions, **options},
        },
        "lr_scheduler": {"provider": "piecewise", "options": SCHEDULE.model_dump(mode="json")},
    }


def _engine_run(env: Any, raw: dict[str, Any], out: str, check_components: bool = True) -> None:
    """Train; rank r saves its stages' param groups (names, weight decay), the LRs and losses, and its
    stages' final parameters (FSDP shards gathered) to `<out>-<r>.pt`; a `ConfigError` is saved instead."""
    from torch.distributed.tensor import DTensor

    from d9d.core import DistributedContext
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.trainer import Trainer

    config = parse_config(raw, check_components=check_components)
    points: list[Any] = []
    reporter = LocalRunReporter(config.checkpoint_dir, config.checkpointing.keep_last, points.append)
    trainer = Trainer(config, DistributedContext.create(config.mesh), reporter)
    try:
        trainer.setup()
    except ConfigError as e:
        torch.save({"error": str(e)}, env.tmp_dir / f"{out}-{env.rank}.pt")
        return
    groups = {}
    for stage, optimizer in trainer.parts.optimizer.optimizers.items():
        names = {id(p): n for n, p in trainer.parts.stages.by_index[stage].named_parameters()}
        groups[stage] = [
            (g["weight_decay"], [names[id(p)] for p in g["params"]]) for g in optimizer.param_groups
        ]
    result = trainer.train()
    final_lrs = [g["lr"] for g in trainer.parts.optimizer.param_groups]
    params = {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for module in trainer.modules
        for name, p in module.named_parameters()
    }
    lrs = {p.step: p.values["lr"] for p in points if p.kind == "train" and "lr" in p.values}
    torch.save(
        {
            "groups": groups,
            "losses": list(result.losses),
            "lrs": lrs,
            "final_lrs": final_lrs,
            "params": params,
        },
        env.tmp_dir / f"{out}-{env.rank}.pt",
    )


def _expected_groups(tmp: Path, layout: str) -> dict[int, list[tuple[float, list[str]]]]:
    """Each stage's groups by hand: the meta-built stage's parameters, exempt by regex or shape."""
    from d9d.pipeline.api import PipelineStageInfo

    raw = _engine_job(tmp, "expected", layout, STEPS)
    model = build_model(parse_config(raw).model)
    options = raw["optimizer"]["options"]
    stages = raw["mesh"].get("pipeline_parallel", 1)
    expected = {}
    for index in range(stages):
        with torch.device("meta"):
            stage = model.build_stage(PipelineStageInfo(index, stages))
        exempt = [
            n
            for n, p in stage.named_parameters()
            if any(re.fullmatch(r, n) for r in options.get("no_weight_decay", []))
            or (options.get("no_weight_decay_1d", False) and p.ndim == 1)
        ]
        decayed = [n for n, _ in stage.named_parameters() if n not in exempt]
        expected[index] = [(w, names) for w, names in ((0.5, decayed), (0.0, exempt)) if names]
    return expected


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(ENGINE_LAYOUTS))
def test_engine_groups_and_a_resume_equal_the_uninterrupted_run(tmp_path: Path, layout: str) -> None:
    """2 gloo ranks: each stage's groups are the hand-computed ones (under pp 2 the second stage has no
    exempt group), and a run stopped at step 3 and resumed equals the straight 6 steps bit for bit (losses,
    parameters, both groups' learning rates)."""
    from tests.engine_fixtures import make_hf_qwen3
    from tests.harness import run_distributed

    make_hf_qwen3(tmp_path / "hf", num_layers=4)
    run_distributed(
        _engine_run,
        2,
        _engine_job(tmp_path, "straight", layout, STEPS),
        "straight",
        tmp_dir=tmp_path,
        timeout=240,
    )
    run_distributed(
        _engine_run, 2, _engine_job(tmp_path, "split", layout, STOP), "first", tmp_dir=tmp_path, timeout=240
    )
    run_distributed(
        _engine_run, 2, _engine_job(tmp_path, "split", layout, STEPS), "second", tmp_dir=tmp_path, timeout=240
    )
    expected = _expected_groups(tmp_path, layout)
    for rank in range(2):
        straight, first, second = (
            torch.load(tmp_path / f"{n}-{rank}.pt") for n in ("straight", "first", "second")
        )
        for run in (straight, first, second):
            assert run["groups"] == {s: expected[s] for s in run["groups"]}, rank
        assert len(second["losses"]) == STEPS
        assert second["losses"] == straight["losses"], rank
        resumed_lrs = {step: lr for step, lr in second["lrs"].items() if step > STOP}
        assert resumed_lrs == {step: lr for step, lr in straight["lrs"].items() if step > STOP}
        assert len(resumed_lrs) == (STEPS - STOP if rank == 0 else 0)  # rank 0 reports them
        assert second["final_lrs"] == straight["final_lrs"]
        assert len(set(straight["final_lrs"])) == 1  # the schedule scales every group alike
        assert straight["params"].keys() == second["params"].keys()
        for name, tensor in straight["params"].items():
            assert torch.equal(second["params"][name], tensor), (rank, name)
    if layout == "pp2":
        assert len(expected[0]) == 2 and len(expected[1]) == 1


@pytest.mark.distributed
def test_a_pattern_matching_no_stage_is_refused_by_every_rank_before_training(tmp_path: Path) -> None:
    from tests.engine_fixtures import make_hf_qwen3
    from tests.harness import run_distributed

    make_hf_qwen3(tmp_path / "hf", num_layers=4)
    raw = _engine_job(
        tmp_path, "typo", "pp2", STEPS, no_weight_decay=[r"model\.norm\.weight", r"model\.nrom\.weight"]
    )
    expected = (
        "optimizer.options.no_weight_decay[1] 'model\\\\.nrom\\\\.weight' fully matches no parameter of the "
        "model (re.fullmatch against 47 parameter names; closest: model.norm.weight"
    )
    # refused by the config validation a launcher runs before any rank starts ...
    with pytest.raises(ConfigError, match=re.escape(expected)):
        parse_config(raw)
    # ... and by every rank, when one is started from a config that skipped it
    run_distributed(_engine_run, 2, raw, "typo", False, tmp_dir=tmp_path, timeout=240)
    for rank in range(2):
        assert torch.load(tmp_path / f"typo-{rank}.pt")["error"].startswith(expected)
    assert not (tmp_path / "typo" / "checkpoints").exists() or not any(
        (tmp_path / "typo" / "checkpoints").iterdir()
    )


@pytest.mark.distributed
def test_a_resume_that_changes_the_exemptions_is_refused(tmp_path: Path) -> None:
    """The exemptions are part of the run identity: a resume that adds, removes or edits them is refused
    before anything starts, naming the keys."""
    from d9d.engine.identity import IdentityError
    from d9d.engine.resume import check_resume
    from tests.engine_fixtures import make_hf_qwen3
    from tests.harness import run_distributed

    make_hf_qwen3(tmp_path / "hf", num_layers=4)
    run_distributed(
        _engine_run, 2, _engine_job(tmp_path, "run", "fsdp2", STOP), "first", tmp_dir=tmp_path, timeout=240
    )
    check_resume(parse_config(_engine_job(tmp_path, "run", "fsdp2", STEPS)))  # the same exemptions: fine
    changed = _engine_job(
        tmp_path, "run", "fsdp2", STEPS, no_weight_decay_1d=False, no_weight_decay=[r"lm_.*"]
    )
    with pytest.raises(IdentityError) as error:
        check_resume(parse_config(changed))
    message = str(error.value)
    assert 'optimizer.options.no_weight_decay: ["lm_head\\\\..*"] -> ["lm_.*"]' in message
    assert 'optimizer.options.no_weight_decay_1d: true -> "<unset>"' in message
