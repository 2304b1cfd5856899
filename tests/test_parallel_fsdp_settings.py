"""FSDP settings (`FSDPConfig`: reshard policy, reduce dtype, explicit prefetch) against independent
references.

- Every setting trains a tiny Qwen3 through the decoder plan (`parallelize_qwen3`: embedding, layers and head
  as units) under FSDP 4 and HSDP 2 × 2 exactly like one process (losses, gradient norms, parameters after
  each of 2 AdamW steps, 2 microbatches per step).
- The settings do what they say, observed from outside FSDP: the number of all-gathers issued when each unit
  computes (forward and backward) follows the prefetch depth and the reshard policy; after forward the
  units the policy keeps hold unsharded (plain) parameters and the others their sharded DTensors; a forward
  without grad leaves every unit sharded.
- `reduce_dtype: float32` on a bf16-parameter model: FSDP's reduce-scatter returns exactly the float64 sum of
  the ranks' bf16 gradients rounded once to bf16 (a bf16 reduction does not); through the synchronizer
  (FSDP 4, HSDP 2 × 2, 2 microbatches) the gradients are closer to a float64 model's than with a bf16
  reduction, and HSDP's replica all-reduce runs in float32 buckets.
- `layers_per_unit`: consecutive layers form one unit (one all-gather for them; `auto` groups them when
  the units stay gathered, not when they are resharded), training as one process.
- pp 2 × FSDP 2 under ZBV (split backward) with each reshard policy, deep prefetching and layers grouped
  into units: losses and every gradient equal one process over 2 SGD steps.
- The job config: defaults, `--set model.options.parallel.fsdp.*` overrides, errors naming the field, the
  replaced `fsdp_reshard_after_forward` refused with the new name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from d9d.core import DeviceMeshParameters, DistributedContext, MeshDomain
from d9d.engine.config import ConfigError, load_config
from d9d.models.decoder.plan import fsdp_units
from d9d.models.qwen3 import parallelize_qwen3
from d9d.parallel import (
    GradientSynchronizer,
    GradSyncConfig,
    build_gradient_synchronizer,
    collect_synced_params,
)
from d9d.parallel.fsdp import FSDPConfig, fsdp_gathered_bytes, parallelize_fsdp, parallelize_hsdp
from d9d.parallel.plans import ParallelPlanConfig
from d9d.pipeline.schedule.config import build_schedule
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_qwen3 import MAX_NORM, _batches, _dense, _task_loss
from tests.test_parallel_reference import assert_runs_close, distributed_run, reference_run
from tests.test_pipeline_executor import reference_model, schedule_adapter
from tests.test_pipeline_sharded import _executors, _train_and_compare

# ---- every setting trains like one process, and does what it says ----------------------------------------


def _gathered_bytes() -> int:
    """The tiny model's parameters, unsharded (float32; tied weights once): what every rank holds when all
    units stay gathered."""
    return sum(p.numel() * 4 for p in _dense().parameters())


SETTINGS: list[tuple[int, int, FSDPConfig]] = [  # (replicate, shard, settings)
    (1, 4, FSDPConfig()),  # auto, under keep_gathered_gib: every unit stays gathered
    (1, 4, FSDPConfig(keep_gathered_gib=0)),  # auto resharding all but the root and the last unit
    (1, 4, FSDPConfig(reshard_after_forward="always", forward_prefetch=1)),
    (
        1,
        4,
        FSDPConfig(
            reshard_after_forward="never", forward_prefetch=2, backward_prefetch=3, reduce_dtype="float32"
        ),
    ),
    (2, 2, FSDPConfig(forward_prefetch=1, backward_prefetch=2, reduce_dtype="float32")),
    (2, 2, FSDPConfig(reshard_after_forward="always", backward_prefetch=2)),
    (2, 2, FSDPConfig(reshard_after_forward="never", forward_prefetch=3)),
]


GATHER = "all_gather_single|all_gather_into_tensor"
SCATTER = "reduce_scatter_single|reduce_scatter_tensor"


@contextlib.contextmanager
def counting_collectives(*groups: str) -> Iterator[dict[str, int]]:
    """Calls of the first existing `torch.distributed` function of each group (`GATHER`, `SCATTER`: FSDP2
    calls `all_gather_single` / `reduce_scatter_single`; torch before 2.12 `all_gather_into_tensor` /
    `reduce_scatter_tensor`), by group."""
    counts: dict[str, int] = {}
    patched: list[tuple[str, Any]] = []
    for group in groups:
        name = next(n for n in group.split("|") if hasattr(dist, n))
        real = getattr(dist, name)
        counts[group] = 0

        def counting(*args: Any, _real: Any = real, _group: str = group, **kwargs: Any) -> Any:
            counts[_group] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counting)
        patched.append((name, real))
    try:
        yield counts
    finally:
        for name, real in patched:
            setattr(dist, name, real)


def _first_with_params(unit: nn.Module) -> nn.Module:
    return next(m for m in unit.modules() if m is not unit and any(True for _ in m.parameters(recurse=False)))


def _is_sharded(module: nn.Module) -> bool:
    kinds = {isinstance(p, DTensor) for p in module.parameters()}
    assert len(kinds) == 1, f"{type(module).__name__} holds sharded and gathered parameters at once"
    return kinds.pop()


def _probe(model: nn.Module, units: list[nn.Module], config: FSDPConfig, what: str) -> None:
    """One forward/backward watched from hooks: all-gathers issued by the time each unit computes, and which
    units hold gathered parameters between forward and backward."""
    n = len(units)
    policy = config.reshard_after_forward
    small = _gathered_bytes() <= config.keep_gathered_gib * 2**30
    keep_all = policy == "never" or (policy == "auto" and small)
    resharded = [not keep_all and (policy == "always" or i < n - 1) for i in range(n)]
    in_units = {id(p) for u in units for p in u.parameters()}
    # By name: FSDP registers other parameter objects while a group is gathered.
    root_names = [name for name, p in model.named_parameters() if id(p) not in in_units]
    assert root_names, what  # the final norm: the root gathers once before the first unit

    def root_sharded() -> bool:
        kinds = {isinstance(model.get_parameter(name), DTensor) for name in root_names}
        assert len(kinds) == 1, what
        return kinds.pop()

    root_resharded = policy == "always"
    forward_seen: list[int] = []
    backward_seen: dict[int, int] = {}
    handles = []
    with counting_collectives(GATHER) as count:
        for i, unit in enumerate(units):
            # A hook registered after FSDP's runs after its pre-forward (gather and prefetch) did.
            handles.append(
                unit.register_forward_pre_hook(lambda _m, _a, i=i: forward_seen.append(count[GATHER]))
            )
            if (
                0 < i < n - 1
            ):  # a decoder layer: its first norm's backward comes after the layer's pre-backward
                handles.append(
                    _first_with_params(unit).register_full_backward_pre_hook(
                        lambda _m, _g, i=i: backward_seen.__setitem__(i, count[GATHER])
                    )
                )
        batch = _batches(1, 4)[0]
        loss = _task_loss(model, batch)
        assert [not _is_sharded(u) for u in units] == [not r for r in resharded], (what, "after forward")
        assert root_sharded() == root_resharded, (what, "root after forward")
        loss.backward()
    for handle in handles:
        handle.remove()
    forward_total = 1 + n
    want_forward = [1 + min(i + 1 + config.forward_prefetch, n) for i in range(n)]
    assert forward_seen == want_forward, (what, "forward all-gathers", forward_seen, want_forward)
    reverse = list(reversed(range(n)))
    for i, seen in backward_seen.items():
        k = reverse.index(i)  # backward runs the units last to first; each prefetches the next ones
        issued = [j for j in reverse[: min(k + 1 + config.backward_prefetch, n)] if resharded[j]]
        want = forward_total + int(root_resharded) + len(issued)
        assert seen == want, (what, f"backward all-gathers at unit {i}", seen, want)
    assert len(backward_seen) == n - 2, what
    assert all(_is_sharded(u) for u in units), (what, "after backward")
    with torch.no_grad():
        _task_loss(model, batch)
    assert all(_is_sharded(u) for u in units) and root_sharded(), (
        what,
        "a forward without grad leaves every unit sharded",
    )
    model.zero_grad(set_to_none=True)


def _assert_trains_like_one_process(
    model: nn.Module,
    ctx: DistributedContext,
    params: DeviceMeshParameters,
    data: list[Any],
    want: Any,
    what: str,
) -> None:
    """2 microbatches per rank and step through the synchronizer: losses, norms, parameters as `want`."""
    sync = build_gradient_synchronizer(model, ctx, GradSyncConfig(bucket_size_mb=0.002))
    dp = ctx.coordinates("batch")["dp"]
    local = [b.shard(params.data_parallel, dp).split(2) for b in data]
    got = distributed_run(model, sync, local, _task_loss, max_norm=MAX_NORM)
    assert_runs_close(got, want, what)
    sync.close()


def _settings_cases(env: RankEnv) -> None:
    data = _batches(2, 8)  # the second AdamW step runs on the updated shards and the optimizer's moments
    want = reference_run(_dense(), data, _task_loss, max_norm=MAX_NORM)
    just_over = FSDPConfig(keep_gathered_gib=(_gathered_bytes() - 1) / 2**30)  # one byte short: reshards
    for replicate, shard, settings in [*SETTINGS, (1, 4, just_over)]:
        # The probe watches one unit per layer; layers grouped into units have their own cases below.
        config = settings.model_copy(update={"layers_per_unit": 1})
        what = f"replicate {replicate} × shard {shard} {config!r}"
        params = DeviceMeshParameters(data_parallel_replicate=replicate, data_parallel_shard=shard)
        ctx = DistributedContext.create(params, backend="gloo")
        model = _dense()
        units = fsdp_units(model, list(model.model.decoder_layers().values()))
        assert units[0] is model.model.embed_tokens and units[-1] is model.lm_head and len(units) == 4
        parallelize_qwen3(model, ctx, ParallelPlanConfig(fsdp=config))
        _probe(model, units, config, what)
        _assert_trains_like_one_process(model, ctx, params, data, want, what)
    _grouped_layer_cases(data, want)
    # A reduce dtype set twice, differently, is refused rather than one silently winning.
    model = _dense()
    with pytest.raises(ValueError, match="contradicts"):
        parallelize_fsdp(
            model,
            ctx.mesh_for(MeshDomain.DENSE)["dp_cp_shard"],
            config=FSDPConfig(reduce_dtype="float32"),
            mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
        )


GROUPED: list[tuple[int, int, FSDPConfig, bool]] = [  # (replicate, shard, settings, both layers one unit)
    (1, 4, FSDPConfig(), True),  # auto: the units stay gathered, so layers are grouped (4 per unit)
    (1, 4, FSDPConfig(keep_gathered_gib=0), False),  # auto over the size limit: resharded, one layer a unit
    (2, 2, FSDPConfig(layers_per_unit=2, reshard_after_forward="always", forward_prefetch=1), True),
    (1, 4, FSDPConfig(layers_per_unit=3, keep_gathered_gib=0, reduce_dtype="float32"), True),
]


def _grouped_layer_cases(data: list[Any], want: Any) -> None:
    """`layers_per_unit`: the tiny model's two layers become one unit (`auto` when the units stay gathered;
    3 per unit: the last unit takes what is left), gathered by one all-gather in forward (and one again in
    backward when resharded), and training is still one process's."""
    for replicate, shard, config, grouped in GROUPED:
        what = f"replicate {replicate} × shard {shard} {config!r}"
        params = DeviceMeshParameters(data_parallel_replicate=replicate, data_parallel_shard=shard)
        ctx = DistributedContext.create(params, backend="gloo")
        model = _dense()
        layers = list(model.model.decoder_layers().values())
        parallelize_qwen3(model, ctx, ParallelPlanConfig(fsdp=config))
        states = {id(fully_shard.state(layer)) for layer in layers}  # type: ignore[attr-defined]
        assert len(states) == (1 if grouped else 2), what
        with counting_collectives(GATHER) as count:
            loss = _task_loss(model, _batches(1, 4)[0])
            gathered_in_forward = count[GATHER]
            loss.backward()
        units = 3 if grouped else 4  # embedding, the layers, head
        # Backward gathers again what forward resharded: `always` every unit and the root, `auto` over the
        # size limit all units but the last.
        regathered = {"always": units + 1, "auto": 0 if config.keep_gathered_gib else units - 1}
        want_counts = (1 + units, 1 + units + regathered[config.reshard_after_forward])
        assert (gathered_in_forward, count[GATHER]) == want_counts, (what, count[GATHER])
        model.zero_grad(set_to_none=True)
        _assert_trains_like_one_process(model, ctx, params, data, want, what)


@pytest.mark.distributed
def test_settings_train_like_one_process_and_act_as_configured() -> None:
    run_distributed(_settings_cases, 4, timeout=300)


MOE_SETTINGS: list[tuple[dict[str, int], FSDPConfig]] = [  # (mesh, settings)
    (
        {"data_parallel_shard": 4, "expert_parallel": 4},
        FSDPConfig(keep_gathered_gib=0, reduce_dtype="float32"),
    ),
    ({"data_parallel_shard": 4, "expert_parallel": 2}, FSDPConfig(reshard_after_forward="always")),
    (
        {"data_parallel_replicate": 2, "data_parallel_shard": 2, "expert_parallel": 2},
        FSDPConfig(reshard_after_forward="never", forward_prefetch=2, reduce_dtype="float32"),
    ),
    (
        {"data_parallel_shard": 2, "tensor_parallel": 2},
        FSDPConfig(keep_gathered_gib=0, forward_prefetch=1, backward_prefetch=2, reduce_dtype="float32"),
    ),
]


def _moe_settings_cases(env: RankEnv) -> None:
    """The settings where FSDP meets expert parallelism (expert weights sharded over ep, FSDP over what is
    left, replicated experts summed by the synchronizer) and tensor parallelism: every gradient and two
    AdamW steps as one process."""
    from d9d.models.qwen3_moe import parallelize_qwen3_moe
    from d9d.parallel.expert import AllToAllBackendConfig
    from tests.test_parallel_qwen3 import MODELS

    data = _batches(2, 8)
    want = reference_run(MODELS["qwen3_moe"](), data, _task_loss, max_norm=MAX_NORM)
    for mesh, config in MOE_SETTINGS:
        what = f"{mesh} {config!r}"
        params = DeviceMeshParameters(**mesh)
        ctx = DistributedContext.create(params, backend="gloo")
        model = MODELS["qwen3_moe"]()
        plan = ParallelPlanConfig(fsdp=config, expert_backend=AllToAllBackendConfig(), sequence_parallel=True)
        parallelize_qwen3_moe(model, ctx, plan)
        _assert_trains_like_one_process(model, ctx, params, data, want, what)


@pytest.mark.distributed
def test_settings_with_expert_and_tensor_parallelism_train_like_one_process() -> None:
    run_distributed(_moe_settings_cases, 4, timeout=300)


# ---- float32 reduction of bf16 gradients -------------------------------------------------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32))


def _mse(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).float() - y.float()) ** 2).sum()


def _error(model: nn.Module, want: dict[str, torch.Tensor]) -> float:
    return (
        sum(float((p.grad.full_tensor().double() - want[n]).norm() ** 2) for n, p in model.named_parameters())
        ** 0.5
    )


def _reduce_dtype_cases(env: RankEnv) -> None:
    world = env.world_size
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(64, 32, generator=g).bfloat16()
    per_rank = x.shape[0] // world
    mine = slice(env.rank * per_rank, (env.rank + 1) * per_rank)

    # FSDP's reduce-scatter alone: against the exact (float64) sum of the ranks' bf16 gradients.
    plain = _mlp().bfloat16()
    _mse(plain, x[mine], y[mine]).backward()
    exact = {}
    for name, p in plain.named_parameters():
        total = p.grad.double()
        dist.all_reduce(total)
        exact[name] = total
    ctx = DistributedContext.create(DeviceMeshParameters(data_parallel_shard=world), backend="gloo")
    errors = {}
    for reduce_dtype in ("float32", "bfloat16"):
        model = _mlp().bfloat16()
        config = FSDPConfig(reduce_dtype=reduce_dtype)
        parallelize_fsdp(
            model, ctx.mesh_for(MeshDomain.DENSE)["dp_cp_shard"], units=[model[0], model[2]], config=config
        )
        _mse(model, x[mine], y[mine]).backward()
        for name, p in model.named_parameters():
            assert p.grad.dtype == torch.bfloat16, (
                reduce_dtype,
                name,
            )  # the optimizer's dtype is the parameters'
        errors[reduce_dtype] = _error(model, exact)
        if reduce_dtype == "float32":  # one rounding of the exact sum, bit for bit
            for name, p in model.named_parameters():
                torch.testing.assert_close(
                    p.grad.full_tensor(), exact[name].float().bfloat16(), rtol=0, atol=0
                )
    assert errors["float32"] < errors["bfloat16"], errors

    # Through the synchronizer (2 microbatches, loss weights): against a float64 model on the same values.
    reference = _mlp().bfloat16().double()
    _mse(reference, x.double(), y.double()).backward()
    want = {n: p.grad / x.shape[0] for n, p in reference.named_parameters()}
    halves = [(x[mine][s], y[mine][s]) for s in (slice(0, per_rank // 2), slice(per_rank // 2, None))]
    for replicate in (1, 2):
        params = DeviceMeshParameters(
            data_parallel_replicate=replicate, data_parallel_shard=world // replicate
        )
        ctx = DistributedContext.create(params, backend="gloo")
        dense = ctx.mesh_for(MeshDomain.DENSE)
        errors = {}
        for reduce_dtype in ("float32", "bfloat16"):
            model = _mlp().bfloat16()
            config = FSDPConfig(reduce_dtype=reduce_dtype)
            if replicate == 1:
                parallelize_fsdp(model, dense["dp_cp_shard"], units=[model[0], model[2]], config=config)
            else:
                parallelize_hsdp(
                    model, dense["dp_cp_replicate", "dp_cp_shard"], units=[model[0], model[2]], config=config
                )
            sync = GradientSynchronizer(
                collect_synced_params(model),
                GradSyncConfig(bucket_size_mb=1e-3),
                num_microbatches=2,
                loss_weight_mesh=ctx.mesh_for(MeshDomain.BATCH)["dp"],
            )
            assert {b.buffer.dtype for b in sync.buckets} == {getattr(torch, reduce_dtype)}, (
                replicate,
                reduce_dtype,
            )
            for xs, ys in halves:
                _mse(model, xs, ys).backward()
            sync.wait(float(per_rank))
            errors[reduce_dtype] = _error(model, want)
            sync.close()
        assert errors["float32"] < errors["bfloat16"], (replicate, errors)


@pytest.mark.distributed
def test_float32_reduce_of_bf16_gradients() -> None:
    run_distributed(_reduce_dtype_cases, 4, timeout=120)


# ---- pipeline: pp 2 × FSDP 2 under a split-backward schedule -----------------------------------------------


def _fsdp_stage(config: FSDPConfig) -> Callable[[DistributedContext, nn.Module], None]:
    def parallelize(ctx: DistributedContext, module: nn.Module) -> None:
        layers = list(module.layers.values())
        # Several layers in one unit (`auto` below keep_gathered_gib): one FSDP state driven once per step.
        k = config.resolve_layers_per_unit(fsdp_gathered_bytes(module))
        grouped = [layers[i] if k == 1 else layers[i : i + k] for i in range(0, len(layers), k)]
        ends = [getattr(module, "embed", None), *grouped, getattr(module, "head", None)]
        units = [u for u in ends if u is not None]
        parallelize_fsdp(module, ctx.mesh_for(MeshDomain.DENSE)["dp_cp_shard"], units=units, config=config)

    return parallelize


PIPELINE_SETTINGS = [
    FSDPConfig(reshard_after_forward="always"),
    FSDPConfig(reshard_after_forward="never", forward_prefetch=2, backward_prefetch=2),
    FSDPConfig(reshard_after_forward="auto", forward_prefetch=1, backward_prefetch=3),
    FSDPConfig(reshard_after_forward="always", forward_prefetch=1, layers_per_unit=2),
    FSDPConfig(reshard_after_forward="auto", keep_gathered_gib=0, layers_per_unit=1),
]


def _pipeline_cases(env: RankEnv) -> None:
    ctx = DistributedContext.create(
        DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=2), backend="gloo"
    )
    programs = [
        build_schedule(schedule_adapter.validate_python({"kind": "zbv"}), 2, 4) for _ in PIPELINE_SETTINGS
    ]
    executors = _executors(ctx, reference_model(), programs)
    for config, executor in zip(PIPELINE_SETTINGS, executors, strict=True):
        _train_and_compare(
            ctx, executor, reference_model(), f"zbv pp2 × fsdp2 {config!r}", _fsdp_stage(config)
        )
        reduced = executor.reduced_once_per_step()  # a unit of several layers counted once
        assert reduced and len({id(p) for p in reduced}) == len(reduced), config


@pytest.mark.distributed
def test_pipeline_split_backward_with_each_reshard_policy() -> None:
    run_distributed(_pipeline_cases, 4, timeout=240)


# ---- the job config ----------------------------------------------------------------------------------------

_JOB = {
    "run": {"name": "t"},
    "mesh": {"data_parallel_shard": 2},
    "batching": {"global_batch_size": 8, "microbatch_size": 2},
    "trainer": {"total_steps": 10},
    "model": {
        "provider": "qwen3",
        "options": {
            "architecture": {
                "vocab_size": 43,
                "hidden_size": 16,
                "num_layers": 2,
                "num_attention_heads": 4,
                "num_kv_heads": 2,
                "head_dim": 8,
                "intermediate_size": 24,
            }
        },
    },
    "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
    "task": {"provider": "tests.engine_fixtures:TokenCETask"},
    "optimizer": {"provider": "adamw", "options": {"lr": 1e-3}},
}


def test_job_config_sets_fsdp(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_JOB))
    assert load_config(path).model.options.parallel.fsdp == FSDPConfig(
        reshard_after_forward="auto", reduce_dtype=None, forward_prefetch=0, backward_prefetch=1
    )
    sets = [
        "model.options.parallel.fsdp.reduce_dtype=float32",
        "model.options.parallel.fsdp.reshard_after_forward=never",
        "model.options.parallel.fsdp.forward_prefetch=2",
        "model.options.parallel.fsdp.backward_prefetch=3",
    ]
    assert load_config(path, sets).model.options.parallel.fsdp == FSDPConfig(
        reshard_after_forward="never", reduce_dtype="float32", forward_prefetch=2, backward_prefetch=3
    )
    bad = {
        "model.options.parallel.fsdp.backward_prefetch=0": r"fsdp\.backward_prefetch",
        "model.options.parallel.fsdp.forward_prefetch=-1": r"fsdp\.forward_prefetch",
        "model.options.parallel.fsdp.reduce_dtype=float16": r"fsdp\.reduce_dtype",
        "model.options.parallel.fsdp.reshard_after_forward=true": r"fsdp\.reshard_after_forward",
        "model.options.parallel.fsdp_reshard_after_forward=false": r"replaced by fsdp\.reshard_after_forward",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(path, [override])
