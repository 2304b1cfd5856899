"""MoE balancing as the engine uses it: the balancing loss summed over real tokens when the objective is a
token sum, its logged statistics, the expert bias moved by real tokens' loads only and kept through Hugging
Face export and import."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.core import DistributedContext
from d9d.engine.builtin.models import builtin_provider
from d9d.models.hf import EXPERT_BIAS_CONFIG_KEY, EXPERT_BIAS_HF_NAME, from_pretrained, save_pretrained
from d9d.models.qwen3_moe import Qwen3MoEConfig, Qwen3MoEForCausalLM
from d9d.modules.moe import GroupedExperts, MoELayer, TopKRouter, load_balancing_loss, moe_layers, route_topk
from d9d.pipeline.api import PipelineStageInfo
from d9d.state import read_header
from tests.harness import RankEnv, run_distributed


def _layer() -> MoELayer:
    torch.manual_seed(0)
    router = TopKRouter(16, 4, 2)
    experts = GroupedExperts(4, 16, 8)
    experts.reset_parameters()
    return MoELayer(router, experts, aux_loss_coef=0.05)


def test_per_token_aux_gradient_is_token_count_times_the_mean_one() -> None:
    x = torch.randn(3, 5, 16)
    mean_layer = _layer()
    sum_layer = copy.deepcopy(mean_layer)
    sum_layer.aux_loss_per_token = True
    for layer in (mean_layer, sum_layer):
        (layer(x) * 0).sum().backward()  # only the balancing loss sends gradient to the router
    mean_grad = mean_layer.gate.weight.grad
    sum_grad = sum_layer.gate.weight.grad
    assert mean_grad is not None and sum_grad is not None and mean_grad.abs().sum() > 0
    torch.testing.assert_close(sum_grad, 15 * mean_grad)
    # And the mean-style gradient is exactly coef * d(aux)/dW (an independent autograd computation).
    ref = _layer()
    routing = ref.gate(x.reshape(-1, 16))
    (0.05 * load_balancing_loss(routing.probs, routing.topk_ids)).backward()
    torch.testing.assert_close(mean_grad, ref.gate.weight.grad)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_moe_layer_keeps_the_balancing_loss_gradient(backend: str) -> None:
    """Regression: traced, the function that adds the balancing loss's gradient in backward lost it (the
    router trained as if `aux_loss_coef` were 0 wherever MoE blocks were compiled, CUDA's default)."""
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))
    upstream = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(4))
    eager = _layer()
    eager.aux_loss_per_token = True
    (eager(x) * upstream).sum().backward()
    torch._dynamo.reset()
    layer = _layer()
    layer.aux_loss_per_token = True
    (torch.compile(layer, backend=backend)(x) * upstream).sum().backward()
    without = _layer()
    without.aux_loss_coef = 0.0
    (without(x) * upstream).sum().backward()
    assert eager.gate.weight.grad is not None and without.gate.weight.grad is not None
    assert not torch.allclose(eager.gate.weight.grad, without.gate.weight.grad)  # the loss moves the router
    torch.testing.assert_close(layer.gate.weight.grad, eager.gate.weight.grad)
    torch.testing.assert_close(layer(x), eager(x), rtol=0, atol=0)


# -- the expert bias through Hugging Face export and import ------------------------------------------------


def _biased_model() -> Qwen3MoEForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoEConfig(
        vocab_size=32,
        hidden_size=16,
        num_layers=3,
        num_attention_heads=2,
        num_kv_heads=1,
        head_dim=8,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=(1,),
        expert_bias=True,
    )
    model = Qwen3MoEForCausalLM(config)
    with torch.no_grad():
        for layer in moe_layers([model]):
            assert layer[1].gate.expert_bias is not None
            layer[1].gate.expert_bias.copy_(torch.randn(4))
    return model


def _biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: layer.gate.expert_bias for name, layer in moe_layers([model])}  # type: ignore[misc]


def test_expert_bias_survives_hf_export_and_import(tmp_path: Path) -> None:
    import transformers

    model = _biased_model()
    with pytest.warns(UserWarning, match="transformers will route without it"):
        dest = save_pretrained(model, tmp_path / "hf")
    keys = set(read_header(dest / "model.safetensors").entries)
    assert {f"model.layers.{i}.{EXPERT_BIAS_HF_NAME}" for i in (0, 2)} <= keys
    assert json.loads((dest / "config.json").read_text())[EXPERT_BIAS_CONFIG_KEY] is True

    reloaded = from_pretrained(dest)
    assert isinstance(reloaded.config, Qwen3MoEConfig) and reloaded.config.expert_bias
    expected = _biases(model)
    got = _biases(reloaded)
    assert set(got) == set(expected) == {"model.layers.0.mlp", "model.layers.2.mlp"}
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # the engine's provider initializes from the same directory through its own mapper call
    provider_class = builtin_provider("qwen3_moe")
    provider = provider_class(provider_class.Config(source_checkpoint=dest))
    stage = provider.build_stage(PipelineStageInfo())
    provider.initialize(stage, DistributedContext.local())
    for name, bias in _biases(stage).items():
        assert torch.equal(bias, expected[name]), name
    # without the bias in the config the extra tensors are dropped; transformers ignores them
    plain = from_pretrained(dest, config_overrides={"expert_bias": False})
    assert all(layer.gate.expert_bias is None for _, layer in moe_layers([plain]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(dest)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"


def test_checkpoint_without_expert_bias_starts_it_at_zero(tmp_path: Path) -> None:
    model = _biased_model()
    plain = Qwen3MoEForCausalLM(model.config.model_copy(update={"expert_bias": False}))
    dest = save_pretrained(plain, tmp_path / "hf")
    assert not any(k.endswith(EXPERT_BIAS_HF_NAME) for k in read_header(dest / "model.safetensors").entries)
    reloaded = from_pretrained(dest, config_overrides={"expert_bias": True})
    for bias in _biases(reloaded).values():
        assert torch.equal(bias, torch.zeros(4))


# -- padding stays out of the balancing loss -----------------------------------------------------------------


def test_padding_is_excluded_from_the_balancing_loss_and_its_scale() -> None:
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    layer = _layer()
    layer.aux_loss_per_token = True
    (layer(x, mask) * 0).sum().backward()
    # reference: the loss of the real tokens alone, times their count (the LM loss's normalizer counts them)
    ref = _layer()
    real = x[mask]
    routing = ref.gate(real)
    (0.05 * real.shape[0] * load_balancing_loss(routing.probs, routing.topk_ids)).backward()
    torch.testing.assert_close(layer.gate.weight.grad, ref.gate.weight.grad)
    assert layer.last_aux_loss is not None
    torch.testing.assert_close(layer.last_aux_loss, load_balancing_loss(routing.probs, routing.topk_ids))
    # and out of the expert load that moves the bias: the real tokens' copies per expert
    assert torch.equal(layer.gate.expert_load, torch.bincount(routing.topk_ids.reshape(-1), minlength=4))


def test_decoder_layers_hand_the_padding_mask_to_moe_layers() -> None:
    model = _biased_model()
    captured: dict[str, torch.Tensor] = {}
    layer = model.model.decoder_layers()[0].mlp
    assert isinstance(layer, MoELayer)
    layer.register_forward_pre_hook(lambda _m, args: captured.update(x=args[0].detach()))
    ids = torch.randint(0, 32, (2, 7))
    attention_mask = torch.ones(2, 7, dtype=torch.bool)
    attention_mask[0, 5:] = False
    model(input_ids=ids, attention_mask=attention_mask, labels=ids)["loss"].sum().backward()
    flat = captured["x"].reshape(-1, 16)[attention_mask.reshape(-1)]
    routing = route_topk(flat @ layer.gate.weight.detach().t(), 2, expert_bias=layer.gate.expert_bias)
    assert layer.last_aux_loss is not None
    torch.testing.assert_close(layer.last_aux_loss, load_balancing_loss(routing.probs, routing.topk_ids))


def _token_split_with_padding(env: RankEnv) -> None:
    from d9d.core import DeviceMeshParameters, MeshDomain
    from d9d.parallel.tensor import parallelize_moe_tp

    ctx = DistributedContext.create(DeviceMeshParameters(tensor_parallel=2), backend="gloo")
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    # The tp ranks route the two halves of the same sequences: the balancing loss is the one a single
    # process computes on the whole microbatch (its padding left out), not one per half.
    reference = _layer()
    reference.aux_loss_per_token = True
    (reference(x, mask) * 0).sum().backward()
    assert reference.gate.weight.grad is not None and reference.gate.weight.grad.abs().sum() > 0
    for sequence_parallel in (False, True):
        layer = _layer()
        layer.aux_loss_per_token = True
        parallelize_moe_tp(layer, ctx.mesh_for(MeshDomain.DENSE)["tp"], sequence_parallel=sequence_parallel)
        # under sequence parallelism the tokens arrive split, the mask whole
        local = x.chunk(2, dim=1)[env.rank] if sequence_parallel else x
        (layer(local, mask) * 0).sum().backward()
        what = f"sequence_parallel={sequence_parallel}"
        # the router's gradient is summed over tp in backward (parallelize_moe_tp)
        torch.testing.assert_close(layer.gate.weight.grad, reference.gate.weight.grad, msg=what)
        torch.testing.assert_close(layer.last_aux_loss, reference.last_aux_loss, msg=what)


@pytest.mark.distributed
def test_token_split_moe_keeps_padding_out_of_the_balancing_loss() -> None:
    run_distributed(_token_split_with_padding, 2, timeout=120)


def _balancing_over_two_groups(env: RankEnv) -> None:
    """Four ranks as tp 2 × cp 2, each holding an uneven share of one microbatch's tokens: the loads, the
    probabilities and the token counts are summed over both groups."""
    import torch.distributed as dist

    mesh = torch.arange(4).view(2, 2)  # [cp, tp]: a row is one cp coordinate's tp group, a column a cp group
    tp_group = [dist.new_group(mesh[c].tolist()) for c in range(2)][env.rank // 2]
    cp_group = [dist.new_group(mesh[:, t].tolist()) for t in range(2)][env.rank % 2]
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(13, 16, generator=generator, dtype=torch.float64)
    mask = torch.rand(13, generator=generator) > 0.3
    bounds = [0, 2, 7, 8, 13]  # uneven shares, one of a single token
    reference = _layer().double()
    reference.aux_loss_per_token = True
    (reference(x, mask) * 0).sum().backward()
    layer = _layer().double()
    layer.aux_loss_per_token = True
    layer.shares_tokens_with(tp_group)
    layer.shares_tokens_with(cp_group)
    part = slice(bounds[env.rank], bounds[env.rank + 1])
    (layer(x[part], mask[part]) * 0).sum().backward()
    grad = layer.gate.weight.grad
    assert grad is not None
    dist.all_reduce(grad)  # what the plans' gradient sums over tp and cp add up to
    # the router's probabilities are float32 whatever the layer's dtype: float32 rounding, summed in
    # another order
    torch.testing.assert_close(grad, reference.gate.weight.grad, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(layer.last_aux_loss, reference.last_aux_loss, rtol=1e-6, atol=0)
    assert layer.aux_loss_stats is not None and reference.aux_loss_stats is not None
    torch.testing.assert_close(layer.aux_loss_stats, reference.aux_loss_stats)


@pytest.mark.distributed
def test_balancing_loss_of_a_token_split_over_two_groups_equals_one_process() -> None:
    run_distributed(_balancing_over_two_groups, 4, timeout=120)


def _train_moe(
    env: RankEnv, name: str, mesh: dict[str, int], points: list[Any] | None = None, **sections: Any
) -> Any:
    """Train the tiny Qwen3-MoE of `<tmp>/hf` under `mesh`; `sections` replace the job's sections, and
    `architecture` / `parallel` go into the model's options, `hf` names another checkpoint under `<tmp>`.
    Returns the trainer and its result."""
    from d9d.engine.checkpoint import LocalRunReporter
    from d9d.engine.config import parse_config
    from d9d.engine.trainer import Trainer

    options: dict[str, Any] = {"source_checkpoint": str(env.tmp_dir / sections.pop("hf", "hf"))}
    for key in ("architecture", "parallel"):
        if key in sections:
            options[key] = sections.pop(key)
    job: dict[str, Any] = {
        "run": {"name": name, "dir": str(env.tmp_dir / name)},
        "mesh": mesh,
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": 6},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"save_at_end": False},
        "model": {"provider": "qwen3_moe", "options": options},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }
    config = parse_config(job | sections)
    trainer = Trainer(
        config,
        DistributedContext.create(config.mesh),
        LocalRunReporter(config.checkpoint_dir, 1, None if points is None else points.append),
    )
    trainer.setup()
    return trainer, trainer.train()


def _aux_run(
    env: RankEnv, name: str, mesh: dict[str, int], compiled: bool = False, sequence_parallel: bool = False
) -> None:
    trainer, result = _train_moe(
        env,
        name,
        mesh,
        architecture={"router_aux_loss_coef": 0.5},
        parallel={"sequence_parallel": sequence_parallel},
        batching={"global_batch_size": 4, "microbatch_size": 2},
        trainer={"total_steps": 4},
        # SGD: an update proportional to the gradient (Adam would blow float32 noise in tiny gradient
        # components up to a full learning-rate step)
        optimizer={"provider": "sgd", "options": {"lr": 0.5}},
        compile={"enabled": compiled, "backend": "aot_eager"},
    )
    routers = {
        f"{i}.{n}": (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for i, module in enumerate(trainer.modules)
        for n, p in module.named_parameters()
        if n.endswith("gate.weight")
    }
    if env.rank == 0:
        torch.save((list(result.losses), routers), env.tmp_dir / f"{name}.pt")


@pytest.mark.distributed
def test_balancing_loss_under_tp_and_cp_trains_like_one_process(tmp_path: Path) -> None:
    """With `router_aux_loss_coef > 0` the tp ranks (token-split MoE layers) and the cp ranks each route
    part of the same sequences; the balancing loss is still the whole microbatch's, so the routers train
    as in one process (regression: computed per rank, the objective changed with tp and cp)."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    make_hf_qwen3_moe(tmp_path / "hf", num_layers=2)
    run_distributed(_aux_run, 1, "one", {}, tmp_dir=tmp_path, timeout=300)
    run_distributed(_aux_run, 2, "tp2", {"tensor_parallel": 2}, tmp_dir=tmp_path, timeout=300)
    run_distributed(_aux_run, 2, "cp2", {"context_parallel_shard": 2}, tmp_dir=tmp_path, timeout=300)
    # compiled blocks (aot_eager): the balancing loss's gradient, and its sum over tp traced into them
    run_distributed(_aux_run, 1, "one-compiled", {}, True, tmp_dir=tmp_path, timeout=300)
    run_distributed(_aux_run, 2, "tp2-compiled", {"tensor_parallel": 2}, True, tmp_dir=tmp_path, timeout=300)
    # and the sequence-parallel and context-parallel collectives traced into them
    tp2 = {"tensor_parallel": 2}
    run_distributed(_aux_run, 2, "tp2-sp-compiled", tp2, True, True, tmp_dir=tmp_path, timeout=300)
    cp2 = {"context_parallel_shard": 2}
    run_distributed(_aux_run, 2, "cp2-compiled", cp2, True, tmp_dir=tmp_path, timeout=300)
    losses, routers = torch.load(tmp_path / "one.pt")
    assert len(routers) == 2 and len(losses) == 4
    for name in ("one-compiled", "tp2", "cp2", "tp2-compiled", "tp2-sp-compiled", "cp2-compiled"):
        got_losses, got_routers = torch.load(tmp_path / f"{name}.pt")
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
        for key, weight in routers.items():
            torch.testing.assert_close(got_routers[key], weight, rtol=1e-5, atol=1e-6, msg=f"{name} {key}")


# -- the expert bias under tensor parallelism ----------------------------------------------------------------


def _bias_run(env: RankEnv, name: str, mesh: dict[str, int]) -> None:
    architecture = {"expert_bias": True, "expert_bias_update_rate": 0.01}
    trainer, _ = _train_moe(env, name, mesh, architecture=architecture)
    biases = {
        f"{i}.{n}": m.expert_bias.clone()
        for i, module in enumerate(trainer.modules)
        for n, m in module.named_modules()
        if isinstance(m, TopKRouter) and m.expert_bias is not None
    }
    torch.save(biases, env.tmp_dir / f"{name}-rank{env.rank}.pt")


@pytest.mark.distributed
def test_expert_bias_is_the_same_on_every_tensor_and_context_parallel_rank(tmp_path: Path) -> None:
    """MoE layers run token-parallel over tp, so each tp rank routes different tokens: the expert loads
    are summed over tp before the bias moves, which keeps the bias identical on the tp ranks and equal to
    the tp 1 run's (regression: the ranks drifted apart within 6 steps)."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    make_hf_qwen3_moe(tmp_path / "hf", num_layers=2)
    run_distributed(_bias_run, 1, "tp1", {}, tmp_dir=tmp_path, timeout=300)
    run_distributed(_bias_run, 2, "tp2", {"tensor_parallel": 2}, tmp_dir=tmp_path, timeout=300)
    # the cp ranks route the two halves of each sequence: summed over cp as well
    run_distributed(_bias_run, 2, "cp2", {"context_parallel_shard": 2}, tmp_dir=tmp_path, timeout=300)
    reference = torch.load(tmp_path / "tp1-rank0.pt")
    assert reference and all(b.abs().sum() > 0 for b in reference.values()), "the bias never moved"
    for name, rank in itertools.product(("tp2", "cp2"), (0, 1)):
        got = torch.load(tmp_path / f"{name}-rank{rank}.pt")
        assert got.keys() == reference.keys()
        for key, bias in reference.items():
            assert torch.equal(got[key], bias), (name, rank, key, got[key], bias)


# -- the expert bias with padded microbatches ----------------------------------------------------------------


def _padded_bias_run(env: RankEnv, name: str, mesh: dict[str, int], microbatch: int) -> None:
    corpus = env.tmp_dir / "corpus.txt"
    trainer, result = _train_moe(
        env,
        name,
        mesh,
        # no balancing loss: it is defined per microbatch, so it would change with the grouping by design
        architecture={"expert_bias": True, "expert_bias_update_rate": 0.01, "router_aux_loss_coef": 0.0},
        batching={"global_batch_size": 8, "microbatch_size": microbatch},
        # each microbatch padded to its longest sample (rounded up to 4), not to a fixed length
        data={
            "provider": "text",
            "options": {"dataset": {"paths": [str(corpus)], "max_length": 32}, "pad_to_multiple_of": 4},
        },
    )
    if env.rank == 0:
        biases = {
            f"{i}.{n}": m.expert_bias.clone()
            for i, module in enumerate(trainer.modules)
            for n, m in module.named_modules()
            if isinstance(m, TopKRouter) and m.expert_bias is not None
        }
        torch.save((list(result.losses), biases), env.tmp_dir / f"{name}.pt")


@pytest.mark.distributed
def test_expert_bias_counts_real_tokens_whatever_the_microbatch_grouping(tmp_path: Path) -> None:
    """Samples of different lengths padded per microbatch: which samples share a microbatch (the
    microbatch size, the data-parallel degree that deals them out) decides the padding, and the expert
    bias must not see it — the loads that move it count real tokens only (regression: padding positions
    were routed and counted, so dp 2 and a microbatch change moved the bias by ~20% against one process)."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    make_hf_qwen3_moe(tmp_path / "hf", num_layers=2, vocab_size=259)  # the text provider's byte tokenizer
    (tmp_path / "corpus.txt").write_text(
        "".join(f"{i} {'x' * (i * 7 % 25)}\n" for i in range(64))
    )  # 2-28 bytes
    run_distributed(_padded_bias_run, 1, "one-mb1", {}, 1, tmp_dir=tmp_path, timeout=300)  # no padding
    run_distributed(_padded_bias_run, 1, "one-mb2", {}, 2, tmp_dir=tmp_path, timeout=300)
    run_distributed(
        _padded_bias_run, 2, "dp2-mb2", {"data_parallel_replicate": 2}, 2, tmp_dir=tmp_path, timeout=300
    )
    losses, reference = torch.load(tmp_path / "one-mb1.pt")
    assert reference and all(b.abs().sum() > 0 for b in reference.values()), "the bias never moved"
    for name in ("one-mb2", "dp2-mb2"):
        got_losses, got = torch.load(tmp_path / f"{name}.pt")
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-4, atol=1e-5)
        for key, bias in reference.items():
            assert torch.equal(got[key], bias), (name, key, got[key], bias)


def _eval_bias_run(env: RankEnv, name: str, with_eval: bool) -> None:
    sections: dict[str, Any] = {}
    if with_eval:  # an eval pass after every step
        data = {"provider": "tests.engine_fixtures:GlobalIndexData"}
        sections["eval"] = {"data": data, "batch_size": 4, "batches": 2, "period": 1}
    architecture = {"expert_bias": True, "expert_bias_update_rate": 0.01}
    trainer, result = _train_moe(env, name, {}, architecture=architecture, **sections)
    biases = {
        n: m.expert_bias.clone()
        for module in trainer.modules
        for n, m in module.named_modules()
        if isinstance(m, TopKRouter) and m.expert_bias is not None
    }
    torch.save((list(result.losses), biases), env.tmp_dir / f"{name}.pt")


@pytest.mark.distributed
def test_evaluation_during_training_leaves_the_expert_bias_alone(tmp_path: Path) -> None:
    """The eval set's tokens are not training load: a run that evaluates after every step trains exactly
    as one that never evaluates (regression: eval forwards were counted into the next bias update)."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    make_hf_qwen3_moe(tmp_path / "hf", num_layers=2)
    run_distributed(_eval_bias_run, 1, "without", False, tmp_dir=tmp_path, timeout=300)
    run_distributed(_eval_bias_run, 1, "with", True, tmp_dir=tmp_path, timeout=300)
    losses, biases = torch.load(tmp_path / "without.pt")
    got_losses, got = torch.load(tmp_path / "with.pt")
    assert biases and any(b.abs().sum() > 0 for b in biases.values()), "the bias never moved"
    assert got_losses == losses
    assert got.keys() == biases.keys() and all(torch.equal(got[k], b) for k, b in biases.items()), (
        got,
        biases,
    )


def _logged_aux_run(env: RankEnv, name: str, mesh: dict[str, int]) -> None:
    points: list[Any] = []
    _train_moe(
        env,
        name,
        mesh,
        points,
        architecture={"router_aux_loss_coef": 0.01},
        batching={"global_batch_size": 4, "microbatch_size": 1},
        trainer={"total_steps": 3},
        logging={"progress_bar": "off", "period": 1},
    )
    if env.rank == 0:
        logged = [
            {k: v for k, v in p.values.items() if k.endswith("aux_loss")} for p in points if p.kind == "train"
        ]
        torch.save(logged, env.tmp_dir / f"{name}.pt")


@pytest.mark.distributed
def test_logged_balancing_loss_is_the_mean_over_every_data_parallel_rank(tmp_path: Path) -> None:
    """One sample per microbatch, so dp 2's microbatches are one process's: the logged per-layer balancing
    loss and its mean equal one process's (regression: rank 0's microbatches only)."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    make_hf_qwen3_moe(tmp_path / "hf", num_layers=2)
    run_distributed(_logged_aux_run, 1, "one", {}, tmp_dir=tmp_path, timeout=300)
    run_distributed(_logged_aux_run, 2, "dp2", {"data_parallel_replicate": 2}, tmp_dir=tmp_path, timeout=300)
    one, dp2 = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "dp2.pt")
    assert len(one) == 3 and all("moe/aux_loss" in step for step in one), one
    for got, want in zip(dp2, one, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5), (key, got, want)


def _logged_moe_run(env: RankEnv, runs: list[tuple[str, dict[str, int], str | None]], hf: str = "hf") -> None:
    """Each run's logged `moe/` metrics per step (rank 0 logs) from the checkpoint `<tmp>/<hf>`; SGD keeps
    the runs' weights together."""
    for name, mesh, schedule in runs:
        points: list[Any] = []
        _train_moe(
            env,
            name,
            mesh,
            points,
            hf=hf,
            architecture={"router_aux_loss_coef": 0.01},
            pipelining=None if schedule is None else {"kind": schedule},
            batching={"global_batch_size": 4, "microbatch_size": 1},
            trainer={"total_steps": 3},
            logging={"progress_bar": "off", "period": 1},
            optimizer={"provider": "sgd", "options": {"lr": 0.5}},
        )
        if env.rank == 0:
            logged = [
                {k: v for k, v in p.values.items() if k.startswith("moe/")}
                for p in points
                if p.kind == "train"
            ]
            torch.save(logged, env.tmp_dir / f"{name}.pt")


@pytest.mark.distributed
def test_logged_moe_metrics_cover_every_pipeline_stage(tmp_path: Path) -> None:
    """Under pipelining each rank holds some of the MoE layers; rank 0 logs every layer's expert-load
    metrics (by its global index) and balancing loss, and their mean, as one process running the whole
    model on the same batches does — under a one-stage-per-rank schedule, a V schedule (rank 0 holds the
    first and the last stage), and pp × dp (regression: only rank 0's stages were logged)."""
    from tests.engine_fixtures import make_hf_qwen3_moe

    make_hf_qwen3_moe(tmp_path / "hf", num_layers=6)
    run_distributed(_logged_moe_run, 1, [("one", {}, None)], tmp_dir=tmp_path, timeout=300)
    pp2 = {"pipeline_parallel": 2}
    run_distributed(
        _logged_moe_run,
        2,
        [("pp2-1f1b", pp2, "1f1b"), ("pp2-zbv", pp2, "zbv")],
        tmp_dir=tmp_path,
        timeout=300,
    )
    pp2_dp2 = {"pipeline_parallel": 2, "data_parallel_replicate": 2}
    run_distributed(_logged_moe_run, 4, [("pp2-dp2", pp2_dp2, "1f1b")], tmp_dir=tmp_path, timeout=300)
    # the second stage (layers 3-5 under 1F1B) without experts: its rank balances nothing, joins the gather
    make_hf_qwen3_moe(tmp_path / "hf-dense", num_layers=6, mlp_only_layers=[3, 4, 5])
    run_distributed(_logged_moe_run, 1, [("one-dense", {}, None)], "hf-dense", tmp_dir=tmp_path, timeout=300)
    dense_pp2 = [("pp2-dense", pp2, "1f1b")]
    run_distributed(_logged_moe_run, 2, dense_pp2, "hf-dense", tmp_dir=tmp_path, timeout=300)
    one = torch.load(tmp_path / "one.pt")
    layers = {f"moe/model.layers.{i}.mlp/{m}" for i in range(6) for m in ("max_load_ratio", "aux_loss")}
    assert len(one) == 3 and all(layers | {"moe/aux_loss"} <= set(step) for step in one), one
    one_dense = torch.load(tmp_path / "one-dense.pt")
    assert all(step and not any(".3.mlp" in k or ".5.mlp" in k for k in step) for step in one_dense), (
        one_dense
    )
    for name, reference in (("pp2-1f1b", one), ("pp2-zbv", one), ("pp2-dp2", one), ("pp2-dense", one_dense)):
        got_steps = torch.load(tmp_path / f"{name}.pt")
        assert len(got_steps) == 3, name
        for step, (got, want) in enumerate(zip(got_steps, reference, strict=True), 1):
            assert got.keys() == want.keys(), (name, step, sorted(set(want) ^ set(got)))
            for key, value in want.items():
                assert got[key] == pytest.approx(value, rel=1e-5), (name, step, key, got[key], value)
