"""Regional compilation: one graph for all decoder blocks, no graph breaks, eager-equal numerics (inductor's
CPU backend on a tiny model), one warning on a compile failure, and the config-time availability check."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from d9d.parallel.compile import (
    CompileConfig,
    CompileReport,
    check_compile_available,
    compile_stage,
    regions_at_recompile_limit,
)
from d9d.pipeline.api import PipelineStageInfo
from tests.harness import RankEnv, run_distributed
from tests.test_parallel_reference import assert_runs_close, distributed_run, reference_run

CPU = torch.device("cpu")
VOCAB = 64


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Graph counts are per process: every test starts and ends with an empty dynamo cache (and with the
    process-wide donated-buffer flag that `compile_stage(split_backward=True)` turns off restored)."""
    torch._dynamo.reset()
    counters.clear()
    with torch._functorch.config.patch(donated_buffer=True):
        yield
    torch._dynamo.reset()


def _config(**overrides: object) -> Qwen3Config:
    fields: dict[str, object] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
        "attention_backend": "torch",
        "loss_chunk_size": 16,
    }
    fields.update(overrides)
    return Qwen3Config.model_validate(fields)


def _model(config: Qwen3Config | None = None, stage: PipelineStageInfo | None = None) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config or _config(), stage)


def _batch(seq: int, seed: int = 0, batch: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


@dataclass
class _Loss:
    loss_sum: torch.Tensor
    weight: torch.Tensor


def _loss(model: nn.Module, batch: dict[str, torch.Tensor], **extra: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(**batch, **extra)["loss"].sum()
    return out


def _assert_loss_and_grads_match(
    eager: nn.Module, compiled: nn.Module, batch: dict[str, torch.Tensor], tol: float, **extra: object
) -> None:
    """One forward and backward of each: the compiled loss and every gradient within `tol` of eager's."""
    want, got = _loss(eager, batch, **extra), _loss(compiled, batch, **extra)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    want.backward()
    got.backward()
    reference = {n: p.grad for n, p in eager.named_parameters()}
    for name, param in compiled.named_parameters():
        torch.testing.assert_close(param.grad, reference[name], rtol=10 * tol, atol=tol / 10, msg=name)


def test_all_blocks_share_one_graph_without_breaks() -> None:
    """Four layers (one with a sliding window), a left-padding key mask prepared once per forward, and
    activation checkpointing: one graph per distinct window, no graph break under fullgraph, the same
    numbers as eager; a second batch of the same shape compiles nothing, and bucketed lengths recompile
    once (the length turns dynamic) and never again."""
    config = _config(num_layers=4, sliding_window=4, sliding_window_layers=(3,))
    eager, compiled = _model(config), _model(config)
    compiled.model.set_activation_checkpointing()
    report = compile_stage(compiled, CompileConfig(enabled=True, fullgraph=True, backend="aot_eager"), CPU)
    assert report.enabled and report.regions == ("decoder_blocks",) and report.modules == 4
    assert "compiled 4 modules" in report.reason
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, :3] = 0
    for seed in range(2):
        batch = _batch(16, seed)
        torch.testing.assert_close(
            _loss(compiled, batch, attention_mask=padding), _loss(eager, batch, attention_mask=padding)
        )
    assert report.stats.graphs == 2  # full attention and the windowed layer; shared by the 4 blocks
    assert counters["stats"]["unique_graphs"] == 2 and not counters["graph_break"]
    for seq in (24, 32):
        _loss(compiled, _batch(seq)).backward()
    assert report.stats.graphs == 4  # each window once more, with a dynamic length
    assert report.stats.failure is None and report.stats.compile_seconds > 0


def test_a_region_at_the_recompile_limit_is_found() -> None:
    """Dynamo runs layers past its recompile limit eagerly without raising; `regions_at_recompile_limit`
    (which the engine warns with after the first step) finds the region from its cache entries. Two
    windows are two legitimate variants: under a limit of 2 that is the limit, under the default it is not."""
    config = _config(num_layers=4, sliding_window=4, sliding_window_layers=(3,))
    compiled = _model(config)
    compile_stage(compiled, CompileConfig(enabled=True, fullgraph=True, backend="aot_eager"), CPU)
    _loss(compiled, _batch(16)).backward()
    assert regions_at_recompile_limit() == []
    with torch._dynamo.config.patch(recompile_limit=2):
        assert regions_at_recompile_limit() == ["decoder_blocks"]


def test_pipeline_stage_compiles_only_its_layers_and_the_opt_in_loss_head() -> None:
    config = _config(num_layers=4)
    last = _model(config, PipelineStageInfo(current_stage=1, num_stages=2))
    report = compile_stage(
        last,
        CompileConfig(
            enabled=True, fullgraph=True, backend="aot_eager", regions=("decoder_blocks", "loss_head")
        ),
        CPU,
    )
    assert report.regions == ("decoder_blocks", "loss_head") and report.modules == 3  # 2 layers + the head
    hidden = torch.randn(2, 8, 32, requires_grad=True)  # as a later stage receives it: part of the graph
    expected = _model(config, PipelineStageInfo(current_stage=1, num_stages=2))(
        hidden_states=hidden, labels=_batch(8)["labels"]
    )["loss"]
    got = last(hidden_states=hidden, labels=_batch(8)["labels"])["loss"]
    torch.testing.assert_close(got, expected)
    assert report.stats.graphs == 2 and not counters["graph_break"]  # one for the blocks, one for the head


def test_flex_block_masks_enter_the_compiled_blocks_without_recompiling() -> None:
    """Packed documents through FlexAttention inside the compiled blocks: block masks are built once per
    forward outside them and passed in; new segment ids each batch reuse the one graph. (Forward only: CPU
    FlexAttention has no backward.)"""
    config = _config(num_layers=3, attention_backend="flex")
    eager, compiled = _model(config), _model(config)
    report = compile_stage(compiled, CompileConfig(enabled=True, fullgraph=True, backend="aot_eager"), CPU)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (2, 16), generator=g)
            segments = torch.randint(0, 3, (2, 16), generator=g).sort(-1).values
            torch.testing.assert_close(
                compiled(input_ids=ids, segment_ids=segments)["logits"],
                eager(input_ids=ids, segment_ids=segments)["logits"],
            )
    assert report.stats.graphs == 1 and not counters["graph_break"]


def test_compile_is_off_by_default_on_cpu_and_leaves_the_model_alone() -> None:
    model = _model()
    report = compile_stage(model, CompileConfig(), CPU)
    assert report == CompileReport(enabled=False, regions=(), reason="off by default on cpu")
    assert "forward" not in vars(model.model.layers["0"])
    disabled = compile_stage(model, CompileConfig(enabled=False), torch.device("cuda"))
    assert not disabled.enabled and disabled.reason == "disabled"


def test_inductor_forward_gradients_and_30_training_steps_match_eager() -> None:
    """Inductor's CPU code on the tiny model: first-step loss and every gradient, then 30 AdamW steps with
    losses within tolerance of the eager model's."""
    eager = _model()
    compiled = copy.deepcopy(eager)
    report = compile_stage(compiled, CompileConfig(enabled=True, fullgraph=True), CPU)
    _assert_loss_and_grads_match(eager, compiled, _batch(16), 1e-5)
    assert report.stats.graphs == 1 and report.stats.failure is None
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    for name, model in (("eager", eager), ("compiled", compiled)):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(30):
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, _batch(16, seed=step % 4))
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["compiled"][-1] < losses["compiled"][0] * 0.8  # it trains
    torch.testing.assert_close(losses["compiled"], losses["eager"], rtol=1e-3, atol=1e-3)
    assert report.stats.graphs == 1  # 30 steps, no recompilation


class _DataDependentBlock(nn.Module):
    """Python branching on a tensor value: a graph break, which `fullgraph=True` refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.linear(x)
        if y.sum() > 0:
            return y * 2
        return y - 1


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": _DataDependentBlock(), "1": _DataDependentBlock()})

    def decoder_layers(self) -> dict[int, nn.Module]:
        return {int(k): v for k, v in self.layers.items()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x


def test_compile_failure_falls_back_to_eager_with_one_warning() -> None:
    torch.manual_seed(0)
    eager = _Stack()
    model = copy.deepcopy(eager)
    report = compile_stage(model, CompileConfig(enabled=True, fullgraph=True, backend="aot_eager"), CPU)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            torch.testing.assert_close(model(x), eager(x))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "torch.compile failed (Unsupported" in messages[0], messages
    assert report.stats.failure is not None and report.stats.failure.startswith("Unsupported")


def test_check_compile_available(monkeypatch: pytest.MonkeyPatch) -> None:
    check_compile_available(CompileConfig(), CPU)  # off by default on CPU: nothing to check
    check_compile_available(CompileConfig(enabled=True), CPU)  # this machine has g++
    # inductor's own patching: monkeypatch's undo deleted the option (inductor then failed in every later
    # test of the process: "torch._inductor.config.cpp.cxx does not exist")
    with (
        torch._inductor.config.patch({"cpp.cxx": ("/no/such/c++",)}),
        pytest.raises(ValueError, match=r"compile.enabled on cpu needs a C\+\+ compiler"),
    ):
        check_compile_available(CompileConfig(enabled=True), CPU)
    check_compile_available(CompileConfig(enabled=False), CPU)
    check_compile_available(CompileConfig(enabled=True, backend="aot_eager"), CPU)  # no code generation
    monkeypatch.setattr(torch, "__version__", "2.4.1+cpu")
    with pytest.raises(ValueError, match=r"needs torch >= 2\.11.*this is torch 2\.4\.1"):
        check_compile_available(CompileConfig(enabled=True, backend="aot_eager"), CPU)
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    with pytest.raises(ValueError, match="not supported on device type 'mps'"):
        check_compile_available(CompileConfig(enabled=True), torch.device("mps"))


def _compiled_parallel_cases(env: RankEnv) -> None:
    """Replication, FSDP2, TP and EP each wrapped around compiled blocks with activation checkpointing (every
    other layer or every layer around the compiled call; under FSDP and TP the op-level policy traced inside
    it), with aot_eager (the traced graphs and the parallel hooks, without inductor's slow CPU code
    generation), against a single-process eager run of the same global batches."""
    from d9d.core import DeviceMeshParameters, DistributedContext
    from d9d.models.qwen3 import parallelize_qwen3
    from d9d.models.qwen3_moe import parallelize_qwen3_moe
    from d9d.modules.checkpointing import (
        FullActivationCheckpointing,
        SelectiveActivationCheckpointing,
        apply_activation_checkpointing,
    )
    from d9d.parallel import GradSyncConfig, build_gradient_synchronizer
    from d9d.parallel.expert import AllToAllBackendConfig
    from d9d.parallel.plans import ParallelPlanConfig
    from tests.test_parallel_qwen3 import MODELS, _batches, _task_loss

    data = _batches(2, 4)
    every_other = SelectiveActivationCheckpointing(every=2)
    ops = SelectiveActivationCheckpointing(ops=("matmul", "attention"))
    for name, params, checkpointing in (
        ("qwen3", DeviceMeshParameters(data_parallel_replicate=2), every_other),
        ("qwen3", DeviceMeshParameters(data_parallel_shard=2), ops),
        ("qwen3", DeviceMeshParameters(tensor_parallel=2), ops),
        # token-split MoE layers: the balancing loss's sum over tp traced into the op-level checkpoint's
        # fullgraph block (its weighted gradient: test_engine_moe_aux.py, where the objective is the engine's)
        ("qwen3_moe", DeviceMeshParameters(tensor_parallel=2), ops),
        # op-level under expert parallelism is refused at config time (the all-to-all breaks the graph)
        (
            "qwen3_moe",
            DeviceMeshParameters(data_parallel_shard=2, expert_parallel=2),
            FullActivationCheckpointing(),
        ),
    ):
        reference = reference_run(MODELS[name](), data, _task_loss, max_norm=0.5)
        ctx = DistributedContext.create(params, backend="gloo")
        model = MODELS[name]()
        apply_activation_checkpointing(model, checkpointing)
        plan = parallelize_qwen3_moe if name == "qwen3_moe" else parallelize_qwen3
        plan(model, ctx, ParallelPlanConfig(expert_backend=AllToAllBackendConfig()))
        report = compile_stage(model, CompileConfig(enabled=True, backend="aot_eager"), CPU)
        assert report.modules == 2
        sync = build_gradient_synchronizer(model, ctx, GradSyncConfig(bucket_size_mb=0.002))
        dp = ctx.coordinates("batch")["dp"]
        local = [b.shard(params.data_parallel, dp).split(2) for b in data]
        got = distributed_run(model, sync, local, _task_loss, max_norm=0.5)
        assert_runs_close(got, reference, f"compiled {name} {params}")
        assert report.stats.failure is None, (name, params, report.stats.failure)
        if name == "qwen3":
            # replicated parameters are swapped to local tensors, and tp-summed ones (q/k norms) to their
            # gradient-summing views, around each block, not inside it: the blocks share one graph
            # (per-submodule hooks recompiled every block, up to dynamo's limit of 8, then ran eager)
            assert report.stats.graphs == 1, (params, report.stats.graphs)
        sync.close()


@pytest.mark.distributed
def test_compiled_blocks_under_fsdp_tp_and_ep() -> None:
    run_distributed(_compiled_parallel_cases, 2, timeout=400)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_kind", ["causal", "right_padding", "documents"])
def test_cuda_compiled_blocks_match_eager(batch_kind: str) -> None:
    """Inductor on CUDA with the `auto` attention backend (SDPA is_causal, or compiled FlexAttention inside
    the compiled blocks): loss and gradients against the eager model, one graph for all layers."""
    device = torch.device("cuda")
    config = _config(
        num_layers=4, hidden_size=128, head_dim=32, intermediate_size=256, attention_backend="auto"
    )
    eager = _model(config).to(device)
    compiled = copy.deepcopy(eager)
    report = compile_stage(compiled, CompileConfig(), device)  # on by default on CUDA
    assert report.enabled
    batch = {k: v.to(device) for k, v in _batch(256, batch=4).items()}
    extra: dict[str, object] = {}
    if batch_kind == "right_padding":
        padding = torch.ones(4, 256, dtype=torch.long, device=device)
        padding[1, 200:] = 0
        batch["labels"] = batch["labels"].masked_fill(padding == 0, -100)
        extra = {"attention_mask": padding, "padding_side": "right"}
    elif batch_kind == "documents":
        extra = {
            "segment_ids": torch.arange(256, device=device).div(64, rounding_mode="floor").expand(4, 256)
        }
    _assert_loss_and_grads_match(eager, compiled, batch, 1e-4, **extra)
    assert report.stats.failure is None and report.stats.graphs == 1


@pytest.mark.parametrize("kind", ["zb1p", "zbv", "dualpipev"])
def test_split_backward_schedules_train_compiled_stages(kind: str) -> None:
    """Zero-bubble schedules (input pass with a retained graph, then the weight pass) over compiled stages:
    the loss and every gradient equal the eager whole model's. Regression: AOTAutograd's donated buffers
    refused the retained graph ("compiled with non-empty donated buffers")."""
    from pydantic import TypeAdapter

    from d9d.pipeline.runtime.executor import PipelineExecutor
    from d9d.pipeline.schedule.config import ScheduleConfig, build_schedule

    config = _config(num_layers=4)
    reference = _model(config)
    program = build_schedule(TypeAdapter(ScheduleConfig).validate_python({"kind": kind}), 1, 3)
    assert program.splits_backward
    full = reference.state_dict()
    stages: dict[int, nn.Module] = {}
    for s in program.placement.stages_of(0):
        stage = _model(config, PipelineStageInfo(s, program.num_stages))
        stage.load_state_dict({k: full[k] for k in stage.state_dict()})
        report = compile_stage(
            stage, CompileConfig(enabled=True, backend="aot_eager"), CPU, split_backward=True
        )
        assert report.modules == len(stage.model.decoder_layers())
        stages[s] = stage
    batches = [_batch(8, seed=i) for i in range(3)]

    def loss_fn(outputs: dict[str, torch.Tensor], mb: int) -> _Loss:
        return _Loss(outputs["loss"].sum(), torch.tensor(float(batches[mb]["labels"].numel())))

    result = PipelineExecutor(program, stages, pp_rank=0, device=CPU).train_step(batches, loss_fn)
    want = sum(_loss(reference, b) for b in batches)
    want.backward()  # type: ignore[union-attr]
    assert result.loss_sum is not None
    torch.testing.assert_close(result.loss_sum, want.detach(), rtol=1e-5, atol=1e-5)  # type: ignore[union-attr]
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for stage in stages.values():
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, grads[name], rtol=1e-4, atol=1e-6, msg=f"{kind} {name}")


def test_compiled_regions_get_their_weight_gradients_in_the_input_pass() -> None:
    """A compiled region's backward is one node computing every gradient: restarting it in the weight pass
    would run the region's backward twice. Its parameters are computed in the input pass; the weight pass
    keeps only the eager parts (here the final norm and the head)."""
    from d9d.pipeline.runtime.stage import StageRuntime

    config = _config(num_layers=2)
    info = PipelineStageInfo(1, 2)
    stage = _model(config, info)
    compile_stage(stage, CompileConfig(enabled=True, backend="aot_eager"), CPU, split_backward=True)
    runtime = StageRuntime(stage, info)

    def loss_fn(outputs: dict[str, torch.Tensor], mb: int) -> _Loss:
        return _Loss(outputs["loss"].sum(), torch.tensor(1.0))

    hidden = torch.randn(2, 8, 32)
    runtime.forward(
        0,
        {"labels": _batch(8)["labels"]},
        {"hidden_states": hidden},
        loss_fn=loss_fn,
        output_fn=None,
        loss_scale=1.0,
    )
    runtime.backward(0, None, split=True)
    blocks = {id(p) for block in stage.model.decoder_layers().values() for p in block.parameters()}
    deferred = runtime._states[0].deferred
    assert deferred is not None
    later = {id(p) for root in deferred._roots for p in root.params}
    assert later and not later & blocks
    assert all(
        p.grad is not None for block in stage.model.decoder_layers().values() for p in block.parameters()
    )
    runtime.backward_weight(0)
    assert all(p.grad is not None for p in stage.parameters())


# -- compile.defer_weight_grads: the projections stay eager, so a weight pass gets their gradients ---------

DEFER = CompileConfig(enabled=True, backend="aot_eager", defer_weight_grads=True)


def _moe_config(num_layers: int) -> Qwen3Config:
    from d9d.models.qwen3_moe import Qwen3MoEConfig

    return Qwen3MoEConfig(
        **_config(num_layers=num_layers).model_dump(),
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
    )


def _stage_model(config: Qwen3Config, info: PipelineStageInfo) -> Qwen3ForCausalLM:
    if hasattr(config, "num_experts"):
        from d9d.models.qwen3_moe import Qwen3MoEForCausalLM

        torch.manual_seed(0)
        return Qwen3MoEForCausalLM(config, info)  # type: ignore[arg-type]  # a Qwen3Config subclass
    return _model(config, info)


def _projection_weights(stage: nn.Module) -> dict[str, nn.Parameter]:
    """The weights `defer_weight_grads` keeps out of the compiled graphs: every Linear's and the experts'."""
    from d9d.modules.moe import GroupedExperts

    return {
        f"{name}.{p_name}": p
        for name, module in stage.named_modules()
        if isinstance(module, nn.Linear | GroupedExperts) and ".layers." in f".{name}"
        for p_name, p in module.named_parameters()
    }


def _split_step(
    stage: nn.Module, info: PipelineStageInfo, hidden: torch.Tensor, labels: torch.Tensor
) -> set[str]:
    """One microbatch through a last stage with split backward; the parameters that had a gradient after the
    input pass."""
    from d9d.pipeline.runtime.stage import StageRuntime

    runtime = StageRuntime(stage, info)

    def loss_fn(outputs: dict[str, torch.Tensor], mb: int) -> _Loss:
        return _Loss(outputs["loss"].sum(), torch.tensor(1.0))

    runtime.forward(
        0, {"labels": labels}, {"hidden_states": hidden}, loss_fn=loss_fn, output_fn=None, loss_scale=1.0
    )
    runtime.backward(0, None, split=True)
    after_input = {n for n, p in stage.named_parameters() if p.grad is not None}
    runtime.backward_weight(0)
    return after_input


def _full_grads(stage: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    stage(hidden_states=hidden.clone().requires_grad_(), labels=labels)["loss"].sum().backward()
    return {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", ["dense", "whole-layer-checkpointing", "moe"])
def test_deferred_weight_grads_leave_the_projections_to_the_weight_pass(variant: str) -> None:
    """With `defer_weight_grads` under split backward, the input pass leaves every projection weight without
    a gradient and the weight pass gives it; the gradients equal an eager full backward's and a compiled
    (whole-block graph) full backward's. Whole-layer checkpointing wraps the compiled block call and
    replays it in either pass; the routed experts' grouped matmuls are deferred like the Linears."""
    config = _moe_config(3) if variant == "moe" else _config(num_layers=3)
    info = PipelineStageInfo(1, 2)  # the last stage: two layers, the final norm and the head
    hidden, labels = torch.randn(2, 8, 32), _batch(8)["labels"]
    eager = _full_grads(_stage_model(config, info), hidden, labels)
    whole = _stage_model(config, info)
    compile_stage(whole, CompileConfig(enabled=True, backend="aot_eager"), CPU, split_backward=True)
    compiled = _full_grads(whole, hidden, labels)

    stage = _stage_model(config, info)
    if variant == "whole-layer-checkpointing":
        stage.model.set_activation_checkpointing()
    report = compile_stage(stage, DEFER, CPU, split_backward=True)
    assert report.deferred_weight_grads and "projections eager" in report.reason
    projections = _projection_weights(stage)
    # per layer: q, k, v, o and the MLP's gate, up, down, or the experts' gate_up_proj and down_proj
    assert len(projections) == 2 * (6 if variant == "moe" else 7)
    after_input = _split_step(stage, info, hidden, labels)
    assert not after_input & set(projections), sorted(after_input & set(projections))
    assert "model.layers.1.input_layernorm.weight" in after_input  # the norms stay compiled: input pass
    assert report.stats.failure is None and counters["graph_break"]  # breaks by design, no fallback
    for name, param in stage.named_parameters():
        # Not bitwise: the input pass sums the gradients meeting at a residual in another order than a full
        # backward does (an eager stage's split backward differs from its full one by as much).
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, eager[name], rtol=1e-5, atol=1e-8, msg=f"eager {name}")
        torch.testing.assert_close(param.grad, compiled[name], rtol=1e-5, atol=1e-8, msg=f"compiled {name}")


def test_deferred_weight_grads_compile_one_set_of_graphs_for_any_number_of_layers() -> None:
    """The fragments between the projections are keyed on code objects every layer shares: 2 and 4 layers
    compile the same graphs, and a second step compiles nothing."""
    graphs = {}
    for layers in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        model = _model(_config(num_layers=layers))
        report = compile_stage(model, DEFER, CPU, split_backward=True)
        assert report.modules == layers
        _loss(model, _batch(16, seed=0)).backward()
        graphs[layers] = report.stats.graphs
        assert graphs[layers] == counters["stats"]["unique_graphs"] > 1  # several fragments per block
        _loss(model, _batch(16, seed=1)).backward()
        assert report.stats.graphs == graphs[layers]  # no recompilation
        assert report.stats.failure is None
    assert graphs[2] == graphs[4]


def test_deferred_weight_grads_need_split_backward_and_exclude_fullgraph() -> None:
    """Without split backward the option changes nothing (no weight pass); with fullgraph it is refused."""
    model = _model()
    report = compile_stage(model, DEFER, CPU, split_backward=False)
    assert not report.deferred_weight_grads and "projections" not in report.reason
    assert "forward" not in vars(model.model.layers["0"].self_attn.q_proj)
    with pytest.raises(ValueError, match=r"compile\.defer_weight_grads with compile\.fullgraph"):
        CompileConfig(defer_weight_grads=True, fullgraph=True)
