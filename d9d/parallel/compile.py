"""Regional `torch.compile`: each decoder block (and the loss head) compiled once for all layers, after
parallelization.

The engine calls `check_compile_available` when it validates the job (a machine where compilation cannot
work fails there, with the reason) and `compile_stage` once a stage is built, parallelized (TP/EP/FSDP2
applied by the provider's plan) and materialized.

How one graph serves every layer: each region's `forward` is replaced by a call into one compiled function
per region kind (`_decoder_block`, `_loss_head`). Dynamo keys its cache on that function's code object, and
inlines the module (`inline_inbuilt_nn_modules`, on by default), so parameters are graph inputs rather than
constants and every layer of the same structure hits the same entry. What would make layers differ was
removed at the source: the attention mask is prepared (dense or block masks per window) once per forward
outside the layers and only read inside them; the rotary tables are plain tensors; per-layer Python state
is limited to the sliding window (one graph per distinct window). Module hooks (FSDP2's all-gather /
reduce-scatter, TP's redistributions on the block itself) stay outside the compiled function because only
`forward` is compiled. Whole-layer activation checkpointing wraps the whole (compiled) block call, hooks
included, and replays it in backward; an op-level policy (`activation_checkpointing.ops`) is instead traced
inside the block's compiled function, where AOTAutograd's partitioner keeps the policy's op outputs and
recomputes the rest in the compiled backward (around the compiled call, torch's selective modes would only
see opaque kernels). That function is compiled with `fullgraph`: a checkpoint dynamo cannot trace whole would
run eagerly with Python side effects replayed, so a graph break there sends the stage to the eager fallback,
where the backbone applies the same policy eagerly around the block call. A stack mixing both (`every: k`
with `ops`) calls each of the two functions for its layers: one graph each, not one per layer.

Deferred weight gradients (`defer_weight_grads`, with a pipeline schedule that splits backward): a compiled
block's backward is one autograd node computing every gradient, so a zero-bubble schedule's weight pass would
find nothing left to compute in it. The block's projections (`nn.Linear`, the routed experts) then call their
forward through one `torch.compiler.disable`d function: dynamo breaks the graph around each call and compiles
the code between them (the block's, attention's and MLP's forwards up to a projection, and the resume
functions after one) as several graphs, each keyed on a code object shared by all layers, so still one set
for the whole stack. The matmuls run eagerly and keep their own backward nodes, whose weight gradients the
split backward defers (`d9d.pipeline.autograd.split_backward`).
"""

from __future__ import annotations

import gc
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, model_validator
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

from d9d.kernels.backend import has_triton
from d9d.modules.checkpointing import take_delegated_policy, traced_checkpoint, traced_context_fn
from d9d.modules.heads import CausalLMHead
from d9d.modules.moe import GroupedExperts

CompileRegion = Literal["decoder_blocks", "loss_head"]
MIN_TORCH = (2, 11)

logger = logging.getLogger(__name__)


class CompileConfig(BaseModel):
    """The job's `compile:` section. `enabled: null` means on for CUDA, off elsewhere.

    - `mode`: `torch.compile`'s mode (`max-autotune-no-cudagraphs` autotunes matmul/flex kernels; slower
      warm-up). `reduce-overhead` replays each compiled block as a CUDA graph (inductor's graph trees, one
      recording per block and microbatch position, made in the second step): for a step whose GPU waits
      for the host's launches, as a pipeline stage's or a replica's at small microbatches. Its outputs
      live in the graphs' memory until the next step (`begin_step`), and a block's parameters must keep
      their addresses, so the job config accepts it only where that was measured to hold
      (`check_cuda_graphs` in `d9d.engine.parallel_checks`).
    - `regions`: what is compiled. `decoder_blocks`: every decoder block, one graph shared by all layers.
      `loss_head`: the chunked linear cross-entropy head; its chunk loop unrolls to the token count, so it
      compiles one graph per distinct batch × sequence size — opt in only with fixed shapes (packing to
      `pack_length`), else the recompile limit is reached and the head runs eager again.
    - `fullgraph`: refuse graph breaks instead of splitting the region (the dense blocks have none; an
      expert-parallel MoE block's all-to-all with data-dependent splits may).
    - `dynamic`: `None` lets dynamo mark a dimension dynamic the first time its size changes (one extra
      compile per region, then bucketed sequence lengths reuse the graph); `False` compiles one graph per
      shape — only with fixed shapes (packing to `pack_length`), or the recompile limit is reached.
    - `backend`: `inductor` generates fused kernels; `aot_eager` traces the same graphs without code
      generation (to tell an inductor bug from a tracing problem, and for fast tests).
    - `defer_weight_grads`: for pipeline schedules that split backward (`pipelining.kind` zb1p, zbv,
      dualpipev; refused with any other schedule or without pipelining). A compiled block's backward is one
      node that computes every gradient, so its weight gradients land in the input pass and the weight pass
      has nothing to fill the bubble with. On: the projections inside each decoder block (every `nn.Linear`
      of attention, MLP and shared experts, and the routed experts' grouped matmuls) run eagerly, outside
      the compiled graphs; dynamo compiles the code between them (norms, rotary, attention core, activation,
      residual adds) as several graphs, still shared by all layers, and the matmuls' own backward nodes let
      the weight pass compute their weight gradients. Costs a graph break around each projection (more
      compiled calls per layer, host overhead); the matmuls are the same library calls either way. Excludes
      `fullgraph` (the block has graph breaks by design). The router's small gate matmul and the norms'
      weights stay compiled, their gradients in the input pass.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool | None = None
    mode: Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead"] = "default"
    regions: tuple[CompileRegion, ...] = ("decoder_blocks",)
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: Literal["inductor", "aot_eager"] = "inductor"
    defer_weight_grads: bool = False

    @model_validator(mode="after")
    def _check_defer_fullgraph(self) -> Self:
        if self.defer_weight_grads and self.fullgraph:
            raise ValueError(
                "compile.defer_weight_grads with compile.fullgraph: deferring keeps each block's projections "
                "out of its compiled graphs, a graph break around each by design, which fullgraph refuses; "
                "set compile.fullgraph: false, or compile.defer_weight_grads: false"
            )
        return self


@dataclass
class CompileStats:
    """Filled in while the stage runs: time spent in calls that compiled (the warm-up), graphs compiled,
    and the reason compilation was abandoned, if it was."""

    compile_seconds: float = 0.0
    graphs: int = 0
    failure: str | None = None
    cuda_graph_skips: int = 0
    """Under `reduce-overhead`: compiled graphs of this process that inductor runs without CUDA graphs (its
    `cudagraph_skips` counter, read at each `begin_step`)."""


@dataclass(frozen=True)
class CompileReport:
    """What `compile_stage` did, for the run's log. `stats` keeps counting after the call returns."""

    enabled: bool
    regions: tuple[str, ...]
    reason: str
    modules: int = 0
    stats: CompileStats = field(default_factory=CompileStats)
    deferred_weight_grads: bool = False
    """The blocks' projections run eagerly (`CompileConfig.defer_weight_grads` under split backward), so a
    weight pass computes their weight gradients."""
    cuda_graphs: bool = False
    """The regions replay as CUDA graphs (`mode: reduce-overhead` with inductor on CUDA): `begin_step`
    marks every step."""


@runtime_checkable
class DecoderStack(Protocol):
    """A backbone whose repeated blocks are compiled as one region (e.g. `Qwen3Model`, whichever layers a
    pipeline stage holds)."""

    def decoder_layers(self) -> Mapping[int, nn.Module]: ...


def begin_step(reports: Iterable[CompileReport]) -> None:
    """Call before each training step's first forward. Under CUDA graphs it starts a
    new generation of inductor's graph trees: the previous step's graph outputs have all been consumed, so
    their memory may be reused. Without the mark the trees cannot tell a new step from more microbatches
    of the last one (measured on one GPU, session 19: they warned of pending backwards and left their fast
    path).

    It also says when inductor decided to run a compiled graph without CUDA graphs (a mutated input, a CPU
    tensor, ...): inductor only logs that under `TORCH_LOGS=cudagraphs`, so a job asking for graphs would
    otherwise run without them, silently slower. Such decisions are made when a graph is compiled or first
    run, so the count is read here, before every step."""
    graphed = [report for report in reports if report.cuda_graphs]
    if not graphed:
        return
    skips = cuda_graph_skips()
    if skips > max(report.stats.cuda_graph_skips for report in graphed):
        logger.warning(
            "compile.mode: reduce-overhead: inductor runs %d compiled graph(s) without CUDA graphs (they "
            "run as plain compiled code, with the host launching every kernel); run with "
            "TORCH_LOGS=cudagraphs to see why, and please report it",
            skips,
        )
    for report in graphed:
        report.stats.cuda_graph_skips = skips
    torch.compiler.cudagraph_mark_step_begin()


def release_cuda_graphs(reports: Iterable[CompileReport]) -> None:
    """Call when training ends (also after an error), before the process group is destroyed: frees the
    graph trees' CUDA graphs. A graph that captured NCCL collectives (the capacity exchange's all-to-alls
    inside a graphed MoE block) holds its communicator, and `destroy_process_group` then waits in
    `ncclCommDestroy` forever (pytorch/pytorch#115388; measured on 2 x H200 with replicas x expert
    parallelism: the run finished, its ranks never exited). No device synchronization: a graph still running
    is freed when it completes, and after an error a stuck collective must not hang this too."""
    if not any(report.cuda_graphs for report in reports):
        return
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    try:
        reset_cudagraph_trees()  # drops every recorded graph of this thread's trees
        gc.collect()  # and whatever cycle still held one
    except Exception as error:  # called from a `finally`: never in place of the error that ended the run
        logger.warning("compile: freeing the CUDA graphs failed (%s: %s)", type(error).__name__, error)


def cuda_graph_skips() -> int:
    """Compiled graphs this process runs without CUDA graphs although their mode asked for them."""
    return int(counters["inductor"]["cudagraph_skips"])


def compile_enabled(config: CompileConfig, device: torch.device) -> bool:
    return config.enabled if config.enabled is not None else device.type == "cuda"


def compiler_modules(config: CompileConfig, device_type: str) -> tuple[str, ...]:
    """Modules a process compiling with `config` imports on its first compile (seconds of imports), for a
    warm standby to import ahead of time."""
    if not compile_enabled(config, torch.device(device_type)) or config.backend != "inductor":
        return ()
    return ("torch._inductor.compile_fx",)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_compile_available(config: CompileConfig, device: torch.device) -> None:
    """Raises ValueError naming why compilation cannot work here when the config enables it (explicitly or
    by default on CUDA); a disabled config is always fine. Cheap: no compilation is attempted."""
    if not compile_enabled(config, device):
        return
    if _torch_version() < MIN_TORCH:
        raise ValueError(
            f"compile.enabled needs torch >= {'.'.join(map(str, MIN_TORCH))} (regional compilation with "
            f"FlexAttention); this is torch {torch.__version__}: upgrade or set compile.enabled: false"
        )
    if config.backend != "inductor":
        return  # no code generation: nothing machine-specific to check
    match device.type:
        case "cuda":
            if not has_triton():
                raise ValueError(
                    "compile.enabled on cuda needs triton (inductor's GPU code generator), which is not "
                    "installed: install it or set compile.enabled: false"
                )
            if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (7, 0):
                raise ValueError(
                    f"compile.enabled on cuda needs compute capability >= 7.0 (triton); {device} has "
                    f"{torch.cuda.get_device_capability(device)}: set compile.enabled: false"
                )
        case "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler

            try:
                get_cpp_compiler()
            except Exception as error:  # inductor raises its own InvalidCxxCompiler (or RuntimeError)
                raise ValueError(
                    f"compile.enabled on cpu needs a C++ compiler for inductor: {error}. Install g++ (or set "
                    "CXX) or set compile.enabled: false"
                ) from error
        case other:
            raise ValueError(f"compile.enabled is not supported on device type {other!r}: set it to false")


_block_epoch = 0
"""Read by every compiled block function, so dynamo guards on its value (`retrace_blocks`)."""


def retrace_blocks() -> None:
    """The next call of every compiled decoder block traces anew. For a change the block's own guards cannot
    see: a graph break deep inside a layer (the expert exchange's read of its split sizes, before its
    capacity is calibrated) ends the block's graph at that layer's call, with no guard on the state behind
    the break, so the block would keep running as pieces after that state made the layer traceable whole."""
    global _block_epoch
    _block_epoch += 1


def compiled_blocks_exist() -> bool:
    """Whether any decoder block has been compiled in this process (so `retrace_blocks` costs a compile).
    False where torch does not expose dynamo's cache entries."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return False
    return any(
        _debug_get_cache_entry_list(fn.__code__)  # type: ignore[attr-defined]
        for fn in (_decoder_block, _checkpointed_decoder_block)
    )


def _decoder_block(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Runs a block's class-level forward (the instance's `forward` is the compiled entry point)."""
    if _block_epoch < 0:  # never true; the read makes dynamo guard on the epoch
        raise AssertionError(_block_epoch)
    return type(block).forward(block, *args, **kwargs)


def _loss_head(head: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A separate code object from `_decoder_block`, so the head's graphs do not count toward the blocks'
    recompile limit."""
    return type(head).forward(head, *args, **kwargs)


def _checkpointed_decoder_block(
    block: nn.Module, context_fn: Callable[[], Any], *args: Any, **kwargs: Any
) -> Any:
    """A decoder block under an op-level checkpoint policy, the checkpoint traced with it (its own code
    object: its graphs have their own cache entries and recompile limit)."""
    if _block_epoch < 0:  # as `_decoder_block`
        raise AssertionError(_block_epoch)
    return traced_checkpoint(type(block).forward, context_fn, block, *args, **kwargs)


_REGION_FUNCTIONS: dict[CompileRegion, Callable[..., Any]] = {
    "decoder_blocks": _decoder_block,
    "loss_head": _loss_head,
}


def regions_at_recompile_limit() -> list[str]:
    """The region functions whose compiled variants have reached dynamo's `recompile_limit`.

    All layers share one code object per region kind, so a property that differs from layer to layer (a
    hook holding the layer's own objects, a per-layer Python attribute) makes dynamo compile one variant per
    layer until the limit, after which it runs the remaining layers eagerly without raising: slow, and
    silent unless someone reads dynamo's own log. Empty where torch does not expose the cache entries."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return []
    limit = int(torch._dynamo.config.recompile_limit)
    functions: list[tuple[str, Callable[..., Any]]] = [
        *_REGION_FUNCTIONS.items(),
        ("decoder_blocks (op-level checkpoint)", _checkpointed_decoder_block),
    ]
    return [
        name
        for name, fn in functions
        if len(_debug_get_cache_entry_list(fn.__code__)) >= limit  # type: ignore[attr-defined]
    ]


def _eager_backward_lowering() -> bool:
    """Whether AOTAutograd can compile the backward together with the forward (so a backward compile
    failure surfaces in the forward call, where the fallback catches it)."""
    return "force_non_lazy_backward_lowering" in torch._functorch.config.get_config_copy()


# Dynamo refuses a checkpointed body that mutates outer state (it would be replayed eagerly); under this flag
# it traces the mutation in the forward only, which is what a d9d layer's statistics want.
_SIDE_EFFECTS_UNDER_CHECKPOINT = {
    key: True
    for key in ("skip_fwd_side_effects_in_bwd_under_checkpoint",)
    if hasattr(torch._dynamo.config, key)
}


def _graph_count() -> int:
    return int(counters["stats"]["unique_graphs"])


class _RegionRunner:
    """The callable installed as a region's `forward`: the compiled function, or — after a compile failure
    anywhere in the stage — the eager forward, with one warning for the whole stage.

    A decoder block's runner also applies an op-level checkpoint policy delegated to its call
    (`d9d.modules.checkpointing.delegate_policy`), through `selective` (the block with the checkpoint traced
    in). After a failure it takes no more policies (`applies_checkpoint_policy` turns false), so the owner
    checkpoints the whole block call eagerly, hooks included: a checkpoint inside the hooks would replay the
    forward with FSDP's parameters resharded. The call that failed runs its block eagerly without
    checkpointing (its hooks have run; it only keeps more activations, once)."""

    def __init__(
        self,
        module: nn.Module,
        compiled: Callable[..., Any],
        stats: CompileStats,
        aot_config: dict[str, bool],
        selective: Callable[..., Any] | None = None,
    ) -> None:
        self.module = module
        self.compiled = compiled
        self.stats = stats
        self.aot_config = aot_config
        self.selective = selective

    @property
    def applies_checkpoint_policy(self) -> bool:
        return self.selective is not None and self.stats.failure is None

    def _eager(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = take_delegated_policy() if self.selective is not None else None
        if self.stats.failure is not None:
            return self._eager(*args, **kwargs)
        before, start = _graph_count(), time.perf_counter()
        try:
            # AOTAutograd reads these when it compiles, which happens inside the first calls.
            with torch._functorch.config.patch(dict(self.aot_config)):
                if policy is None:
                    out = self.compiled(self.module, *args, **kwargs)
                else:
                    assert self.selective is not None
                    # MoE load statistics are forward side effects; the compiled backward recomputes
                    # tensors only, so they are counted once, as `is_recomputing` ensures eagerly.
                    with torch._dynamo.config.patch(_SIDE_EFFECTS_UNDER_CHECKPOINT):
                        out = self.selective(self.module, traced_context_fn(policy), *args, **kwargs)
        except TorchDynamoException as error:
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            self.stats.failure = reason
            warnings.warn(
                f"torch.compile failed ({reason}); the stage runs eager from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return self._eager(*args, **kwargs)
        new_graphs = _graph_count() - before
        if new_graphs > 0:
            self.stats.graphs += new_graphs
            self.stats.compile_seconds += time.perf_counter() - start
        return out


@torch.compiler.disable  # type: ignore[untyped-decorator]  # untyped in torch
def _eager_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A projection's class-level forward with dynamo off: a compiled caller graph-breaks around it."""
    return type(module).forward(module, *args, **kwargs)


class _EagerProjection:
    """Installed as a projection's `forward` inside a compiled block (`CompileConfig.defer_weight_grads`): the
    call leaves the graph, so its matmul's backward stays an eager autograd node (x @ W), which the split
    backward's input pass runs for dx only and its weight pass restarts for dW. One disabled function for all
    projections (not a wrapper per module), so dynamo sees the same callee from every layer."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _eager_forward(self.module, *args, **kwargs)


# What `defer_weight_grads` keeps out of the compiled blocks: every dense projection (attention, MLP, shared
# expert and its gate) and the routed experts (their grouped matmuls, with the SwiGLU between them, which is
# elementwise and cheap next to them).
_PROJECTIONS = (nn.Linear, GroupedExperts)


def _keep_projections_eager(block: nn.Module) -> int:
    projections: list[nn.Module] = [m for m in block.modules() if isinstance(m, _PROJECTIONS)]
    for module in projections:
        # an instance attribute shadows the class's forward; nn.Module.__call__ still runs the hooks (TP's
        # redistributions), which the graph break leaves outside the graph with the matmul
        module.forward = _EagerProjection(module)
    return len(projections)


def _regions(stage: nn.Module, config: CompileConfig) -> Iterator[tuple[CompileRegion, nn.Module]]:
    for region in config.regions:
        match region:
            case "decoder_blocks":
                for module in stage.modules():
                    if isinstance(module, DecoderStack):
                        for block in module.decoder_layers().values():
                            yield region, block
            case "loss_head":
                for module in stage.modules():
                    if isinstance(module, CausalLMHead):
                        yield region, module


def compile_stage(
    stage: nn.Module, config: CompileConfig, device: torch.device, *, split_backward: bool = False
) -> CompileReport:
    """Compiles the stage's regions in place: state-dict keys, parameters and hooks are untouched, only each
    region module's `forward` becomes the shared compiled function. Call after parallelization and
    materialization, and after `check_compile_available`.

    `split_backward`: the stage's backward runs in two autograd calls (a zero-bubble pipeline schedule's input
    and weight passes, `d9d.pipeline.autograd`), the first keeping the graph. A compiled backward then must
    not donate its saved buffers to its outputs (AOTAutograd's `donated_buffer`, which refuses a retained
    graph: the second call would read overwritten activations); this turns donation off for the process.
    With `config.defer_weight_grads` it also keeps the decoder blocks' projections out of the compiled
    graphs (see `CompileConfig`); without `split_backward` that option changes nothing (no weight pass to
    defer to)."""
    if not compile_enabled(config, device):
        reason = "disabled" if config.enabled is False else f"off by default on {device.type}"
        return CompileReport(enabled=False, regions=(), reason=reason)
    stats = CompileStats()
    aot_config: dict[str, bool] = {}
    if _eager_backward_lowering():
        aot_config["force_non_lazy_backward_lowering"] = True
    if split_backward:
        # Process-wide, not patched around the call: AOTAutograd checks the flag again when the backward runs,
        # and a graph compiled without donation fails that check while the flag is on (torch 2.11-2.13).
        torch._functorch.config.donated_buffer = False
    compiled = {
        region: torch.compile(
            _REGION_FUNCTIONS[region],
            backend=config.backend,
            mode=config.mode if config.backend == "inductor" else None,
            fullgraph=config.fullgraph,
            dynamic=config.dynamic,
        )
        for region in config.regions
    }
    defer = config.defer_weight_grads and split_backward
    # The traced op-level checkpoint needs the whole block in one graph (fullgraph), which eager projections
    # break; the config refuses op-level checkpointing with split-backward schedules anyway, and a block
    # without `selective` leaves a policy to the backbone's eager checkpoint around the call.
    selective = (
        torch.compile(
            _checkpointed_decoder_block,
            backend=config.backend,
            mode=config.mode if config.backend == "inductor" else None,
            fullgraph=True,
            dynamic=config.dynamic,
        )
        if "decoder_blocks" in config.regions and not defer
        else None
    )
    regions: set[str] = set()
    count = projections = 0
    for region, module in _regions(stage, config):
        if defer and region == "decoder_blocks":
            projections += _keep_projections_eager(module)
        # an instance attribute shadows the class's forward; nn.Module.__call__ still runs the hooks
        module.forward = _RegionRunner(
            module, compiled[region], stats, aot_config, selective if region == "decoder_blocks" else None
        )
        regions.add(region)
        count += 1
    found = tuple(r for r in config.regions if r in regions)
    reason = f"compiled {count} modules ({', '.join(found) or 'none found'}), mode {config.mode}"
    if defer:
        reason += f", {projections} projections eager (weight gradients deferred)"
    logger.info("compile: %s", reason)
    return CompileReport(
        enabled=bool(count),
        regions=found,
        reason=reason,
        modules=count,
        stats=stats,
        deferred_weight_grads=defer and projections > 0,
        cuda_graphs=bool(count)
        and config.mode == "reduce-overhead"
        and config.backend == "inductor"
        and device.type == "cuda",
    )
