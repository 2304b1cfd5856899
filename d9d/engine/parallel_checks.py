"""Config-time checks of parallelism combinations, so an unsupported job fails before any process group.

Shared by training (`TrainConfig`) and inference (`InferenceConfig`); every message names the keys.
"""

from __future__ import annotations

import torch

from d9d.core.mesh_params import DeviceMeshParameters
from d9d.engine.builtin.models import CausalLMProvider
from d9d.engine.builtin.peft import PeftModelProvider
from d9d.engine.components import (
    BuiltinModel,
    CausalLMTaskComponent,
    ModelPlugin,
    PerplexityTaskComponent,
    TextData,
)
from d9d.engine.registry import PeftModel
from d9d.models.family import check_checkpointing_family, families
from d9d.modules.checkpointing import ActivationCheckpointingConfig, NoActivationCheckpointing
from d9d.parallel.compile import CompileConfig
from d9d.parallel.expert.backend import AllToAllBackendConfig, DeepEPBackendConfig
from d9d.parallel.expert.deepep import INTRANODE_GROUP_SIZES
from d9d.parallel.grad_sync.config import GradSyncConfig
from d9d.peft.config import FullTuneConfig, LoRAConfig, PeftConfig, StackConfig

_CP_KEYS = "mesh.context_parallel_shard × mesh.context_parallel_replicate"

ModelChoice = BuiltinModel | PeftModel | ModelPlugin


def base_model(model: ModelChoice) -> tuple[BuiltinModel | ModelPlugin, str]:
    """The model component that builds the network (PEFT wraps one), and its key."""
    if isinstance(model, PeftModel):
        return model.options.base, "model.options.base"
    return model, "model"


def check_pipeline_parallel(mesh: DeviceMeshParameters, model: ModelChoice, stages_per_rank: int) -> None:
    """The built-in families' causal LMs must split into `pipeline_parallel × stages_per_rank` stages of at
    least one layer each, and cannot share tied embeddings across stages (the embedding is on the first, the
    head on the last)."""
    pp = mesh.pipeline_parallel
    if pp == 1:
        return
    base, field = base_model(model)
    if isinstance(base, ModelPlugin):
        return  # a plug-in's stages are its own business
    where = f"mesh.pipeline_parallel = {pp}"
    provider = CausalLMProvider(base.options)
    architecture = provider.model_config
    if architecture.tie_word_embeddings:
        raise ValueError(
            f"{where}: {field} has tie_word_embeddings (from {field}.options.architecture or the source "
            "checkpoint's config.json), which needs the embedding and the LM head on one stage; untie "
            "them or use pipeline_parallel = 1"
        )
    stages = pp * stages_per_rank
    try:
        provider.stage_layer_counts(stages)
    except ValueError as e:
        raise ValueError(
            f"{where} with {stages_per_rank} stage(s) per rank (pipelining.stages_per_rank): {field}'s "
            f"{architecture.num_layers} layers ({field}.options.parallel.stage_split "
            f"{base.options.parallel.stage_split.kind}): {e}"
        ) from e


def check_model_layout(
    mesh: DeviceMeshParameters, model: ModelChoice, data: object, task: object, stages_per_rank: int
) -> None:
    """The checks training and inference share: the model, data and task against the mesh (context and
    pipeline parallelism, PEFT targets over the stages, LoRA under TP, the expert backend)."""
    check_context_parallel(mesh, model, data, task)
    check_pipeline_parallel(mesh, model, stages_per_rank)
    check_peft_targets(mesh, model, stages_per_rank)
    check_lora_tensor_parallel(mesh, model)
    check_expert_backend(mesh, model)


def check_peft_targets(mesh: DeviceMeshParameters, model: ModelChoice, stages_per_rank: int) -> None:
    """Under pipelining a PEFT pattern may match nothing on some stages (`model\\.norm` is on the last one
    only) but must match on one: each stage of a built-in base is built on meta and injected here, so a
    pattern that matches nothing in the whole model (a typo) is refused before any process starts,
    naming its key. (Without pipelining, each rank's one stage refuses it when built.)"""
    pp = mesh.pipeline_parallel
    if pp == 1 or not isinstance(model, PeftModel) or isinstance(model.options.base, ModelPlugin):
        return  # a plug-in base's stages are checked when the provider builds them
    PeftModelProvider(model.options).check_targets(pp * stages_per_rank)


def check_expert_backend(mesh: DeviceMeshParameters, model: ModelChoice) -> None:
    """DeepEP's intranode kernels take bf16 activations and expert-parallel groups of 2, 4 or 8 ranks: both
    known from the config (whether CUDA and `deep_ep` are there is checked when the stages are built)."""
    base, field = base_model(model)
    if not isinstance(base, BuiltinModel):
        return
    backend = base.options.parallel.expert_backend
    if not isinstance(backend, DeepEPBackendConfig):
        return
    key = f"{field}.options.parallel.expert_backend.kind 'deep_ep'"
    if mesh.expert_parallel not in INTRANODE_GROUP_SIZES:
        raise ValueError(
            f"{key}: its intranode kernels serve expert-parallel groups of {INTRANODE_GROUP_SIZES} ranks, "
            f"got mesh.expert_parallel = {mesh.expert_parallel}; choose kind 'all_to_all' or 'auto'"
        )
    if base.options.dtype != "bfloat16":
        raise ValueError(
            f"{key}: it needs bfloat16 activations, got {field}.options.dtype {base.options.dtype!r}; set "
            "dtype: bfloat16, or choose kind 'all_to_all' or 'auto'"
        )


def check_fsdp_step_reduction(
    mesh: DeviceMeshParameters, model: ModelChoice, grad_sync: GradSyncConfig, accumulation: int
) -> None:
    """Where FSDP reduces a step's gradients once, in or after its last backward — inside a pipeline step
    always, without pipelining under `fsdp.reduce_every: step` with several microbatches — it accumulates
    every microbatch's unsharded gradient itself, in its reduce dtype: the gradient synchronizer (where
    `grad_dtype` applies) sees only the reduced result. A `grad_dtype` wider than the parameters would
    silently not apply to the FSDP-sharded ones, so the FSDP reduce dtype must be at least as wide. Pipeline
    steps cannot reduce every microbatch (a split backward's weight pass comes after the input pass that
    FSDP's per-microbatch reduction hooks into), so `reduce_every: microbatch` is refused with them."""
    if mesh.data_parallel_shard * mesh.context_parallel_shard == 1:
        return  # no FSDP: the synchronizer accumulates the stages' gradients in grad_dtype
    base, field = base_model(model)
    if not isinstance(base, BuiltinModel):
        return  # a plug-in's sharding is its own business (the engine checks what it built)
    fsdp = base.options.parallel.fsdp
    key = f"{field}.options.parallel.fsdp"
    if mesh.pipeline_parallel > 1 and fsdp.reduce_every == "microbatch":
        raise ValueError(
            f"{key}.reduce_every 'microbatch' with mesh.pipeline_parallel = {mesh.pipeline_parallel}: "
            "pipeline steps keep each stage's FSDP units gathered and reduce their gradients once per step; "
            "use reduce_every: auto or step"
        )
    if mesh.pipeline_parallel > 1:
        where = f"mesh.pipeline_parallel = {mesh.pipeline_parallel}: within a pipeline step"
    elif fsdp.reduce_every == "step" and accumulation > 1:
        where = f"{key}.reduce_every 'step' ({accumulation} microbatches per step): within a step"
    else:
        return  # per microbatch (`auto` keeps that when grad_dtype is wider: d9d.engine.step)
    params, reduce_dtype = getattr(torch, base.options.dtype), fsdp.resolve_reduce_dtype()
    if grad_sync.accumulates_wider(params, reduce_dtype):
        grad_dtype = grad_sync.grad_dtype
        accumulated_name = str(reduce_dtype or params).removeprefix("torch.")
        raise ValueError(
            f"gradient_manager.grad_dtype {grad_dtype!r} with FSDP (data_parallel_shard × "
            f"context_parallel_shard = {mesh.data_parallel_shard * mesh.context_parallel_shard}) and {where} "
            f"FSDP accumulates the microbatches' gradients in its reduce dtype ({accumulated_name} here: "
            f"{field}.options.dtype {base.options.dtype!r}, {key}.reduce_dtype {fsdp.reduce_dtype!r}), so "
            f"grad_dtype would not apply to them; set {key}.reduce_dtype: {grad_dtype}"
        )


def check_lora_tensor_parallel(mesh: DeviceMeshParameters, model: ModelChoice) -> None:
    """LoRA-adapted layers cannot be tensor-parallel (the TP styles would shard the factors like the weights
    they sit on): refused here, before any process starts, as the provider refuses it when parallelizing."""
    if mesh.tensor_parallel == 1 or not isinstance(model, PeftModel):
        return
    if _has_lora(model.options.method):
        raise ValueError(
            f"mesh.tensor_parallel = {mesh.tensor_parallel} with model.options.method (LoRA): LoRA-adapted "
            "layers cannot be tensor-parallel; use data (replicate/FSDP), expert or pipeline parallelism"
        )


def _has_lora(method: PeftConfig) -> bool:
    match method:
        case LoRAConfig():
            return True
        case FullTuneConfig():
            return False
        case StackConfig(methods=methods):
            return any(_has_lora(m) for m in methods)


def check_context_parallel(
    mesh: DeviceMeshParameters, model: ModelChoice, data: object, task: object
) -> None:
    """Context parallelism (`cp` > 1) needs a model whose plan installs context-parallel attention (a
    built-in family whose spec says so, also under PEFT) with a kernel that takes arbitrary masks, a
    per-token task (causal LM / perplexity: the batch is split along the sequence), and sequences that split
    into 2·cp chunks."""
    cp = mesh.context_parallel
    if cp == 1:
        return
    where = f"{_CP_KEYS} = {cp}"
    base, field = (
        (model.options.base, "model.options.base") if isinstance(model, PeftModel) else (model, "model")
    )
    capable = [f"'{f.name}'" for f in families() if f.context_parallel]
    if isinstance(base, ModelPlugin):
        raise ValueError(
            f"{where}: {field}.provider {base.provider!r} is a plug-in; context parallelism needs a "
            "model whose parallel plan installs context-parallel attention (the built-in "
            f"{', '.join(capable[:-1])} or {capable[-1]})"
        )
    if not base.options.family.context_parallel:
        raise ValueError(
            f"{where}: {field}.provider {base.provider!r}: the family's parallel plan does not install "
            f"context-parallel attention (families that do: {', '.join(capable)})"
        )
    backend = (base.options.architecture or {}).get("attention_backend", "auto")
    if backend == "flash_attn":
        raise ValueError(
            f"{where}: {field}.options.architecture.attention_backend 'flash_attn' takes plain causal "
            "masks only, and a context-parallel rank's queries are two chunks of the sequence; use "
            "'auto', 'flex' or 'torch'"
        )
    if not isinstance(task, CausalLMTaskComponent | PerplexityTaskComponent):
        raise ValueError(
            f"{where}: task.provider must be 'causal_lm' (training) or 'perplexity' (inference): context "
            "parallelism splits every per-token tensor along the sequence, which a plug-in task's "
            "outputs may not follow"
        )
    if isinstance(data, TextData) and data.options.pad_to_multiple_of % (2 * cp):
        raise ValueError(
            f"{where}: data.options.pad_to_multiple_of={data.options.pad_to_multiple_of} must be a "
            f"multiple of 2·cp = {2 * cp}, so every batch's sequence length splits into 2·cp equal chunks"
        )


def check_activation_checkpointing(
    mesh: DeviceMeshParameters,
    model: ModelChoice,
    checkpointing: ActivationCheckpointingConfig,
    compile_config: CompileConfig,
) -> None:
    """Checkpointing needs a family with a decoder stack (a plug-in is checked when its stages are built);
    op-level selective with compiled blocks refuses expert parallelism (`check_op_checkpointing_compiled`)."""
    if isinstance(checkpointing, NoActivationCheckpointing):
        return
    base, field = base_model(model)
    if isinstance(base, BuiltinModel):
        check_checkpointing_family(base.options.family, f"{field}.provider", checkpointing.mode)
    if compile_config.enabled:  # on CUDA by default too: checked again when the stages are built
        check_op_checkpointing_compiled(mesh, checkpointing)


def check_op_checkpointing_compiled(
    mesh: DeviceMeshParameters, checkpointing: ActivationCheckpointingConfig
) -> None:
    """Op-level selective checkpointing of compiled blocks traces the checkpoint with the block in one graph,
    which expert parallelism's all-to-all (data-dependent splits, run outside the graph) breaks."""
    if getattr(checkpointing, "ops", None) is not None and mesh.expert_parallel > 1:
        raise ValueError(
            f"activation_checkpointing.ops with mesh.expert_parallel = {mesh.expert_parallel} and compiled "
            "blocks (compile.enabled, or on CUDA by default): the experts' all-to-all breaks the compiled "
            "block's graph, so the op-level policy cannot be traced with it; remove activation_checkpointing "
            "`ops` (`every: k` alone, or mode full), or set compile.enabled: false"
        )


CUDA_GRAPH_SCHEDULES = ("1f1b", "interleaved_1f1b")
"""Pipeline schedules under which CUDA graphs of the compiled blocks were measured to replay and to train
like the default mode (engine test on 2 GPUs against one GPU)."""


def check_cuda_graphs(
    mesh: DeviceMeshParameters,
    model: ModelChoice,
    compile_config: CompileConfig,
    checkpointing: ActivationCheckpointingConfig,
    schedule_kind: str,
    *,
    evaluates: bool,
) -> None:
    """`compile.mode: reduce-overhead` only where its graphs were measured to replay and train like the
    default mode: one GPU, replicas (`data_parallel_replicate`: every rank keeps its parameters at fixed
    addresses; the gradient synchronizer's hooks run between the graphed backwards) with or without expert
    parallelism through the capacity exchange (its all-to-alls inside the graphed blocks), or pipeline
    stages alone under a schedule of `CUDA_GRAPH_SCHEDULES`; with the decoder blocks as the only compiled
    region and no activation checkpointing. An eval section (`evaluates`) is accepted without expert
    parallelism: evaluation marks a graph step before each of its forwards (`Evaluator`), and its graphs,
    recorded apart from training's, were measured to give the default mode's eval losses (engine test on 1
    GPU, replicas 2 and pp 2). With expert parallelism an eval forward takes the exchange that reads its
    split sizes (no gradients: no overflow flag is read), whose host reads split the graphed blocks: not
    measured under graphs, so refused."""
    if compile_config.mode != "reduce-overhead" or compile_config.backend != "inductor":
        return
    if compile_config.enabled is False:
        return  # nothing is compiled, so nothing is graphed: the mode is inert
    where = "compile.mode: reduce-overhead (CUDA graphs of the compiled blocks)"
    sharded = {
        "data_parallel_shard": mesh.data_parallel_shard,
        "context_parallel_replicate": mesh.context_parallel_replicate,
        "context_parallel_shard": mesh.context_parallel_shard,
        "tensor_parallel": mesh.tensor_parallel,
    }
    for key, size in sharded.items():
        if size > 1:
            raise ValueError(
                f"{where} with mesh.{key} = {size}: supported on one GPU, with data_parallel_replicate "
                "(and expert_parallel over it) and with pipeline_parallel alone. A graph replays on the "
                "parameter addresses it was recorded with, and FSDP gathers its parameters into new memory "
                "every step (every block call would record anew); the other layouts' collectives in and "
                "around the blocks are not measured under graphs. Use compile.mode: default"
            )
    if mesh.pipeline_parallel > 1 and (mesh.data_parallel_replicate > 1 or mesh.expert_parallel > 1):
        raise ValueError(
            f"{where} with mesh.pipeline_parallel = {mesh.pipeline_parallel}, "
            f"mesh.data_parallel_replicate = {mesh.data_parallel_replicate} and mesh.expert_parallel = "
            f"{mesh.expert_parallel}: pipeline stages are supported alone; replicated or expert-parallel "
            "pipeline stages are not measured under graphs (it takes 4 GPUs). Use compile.mode: default"
        )
    if mesh.expert_parallel > 1:
        _check_graphed_exchange(mesh, model, where)
    if mesh.pipeline_parallel > 1 and schedule_kind not in CUDA_GRAPH_SCHEDULES:
        raise ValueError(
            f"{where} with pipelining.kind={schedule_kind}: supported with "
            f"{', '.join(CUDA_GRAPH_SCHEDULES)}. Under a schedule that splits backward into input and weight "
            "passes the graph trees recorded anew in every step (measured on 2 GPUs, docs/compile.md); use "
            "one of those schedules or compile.mode: default"
        )
    if not isinstance(checkpointing, NoActivationCheckpointing):
        raise ValueError(
            f"{where} with activation_checkpointing.mode={checkpointing.mode}: a checkpoint re-runs the "
            "graphed blocks in backward, which is not measured under graphs; use compile.mode: default, or "
            "activation_checkpointing.mode: none"
        )
    if "loss_head" in compile_config.regions:
        raise ValueError(
            f"{where} with compile.regions containing loss_head: only the decoder blocks are measured under "
            "graphs; remove loss_head from compile.regions, or use compile.mode: default"
        )
    if evaluates and mesh.expert_parallel > 1:
        raise ValueError(
            f"{where} with an eval section and mesh.expert_parallel = {mesh.expert_parallel}: evaluation "
            "runs the expert exchange that reads its split sizes (the capacity exchange is for training "
            "steps), whose host reads split the graphed blocks, which is not measured under graphs; "
            "remove eval, or use compile.mode: default"
        )


def _check_graphed_exchange(mesh: DeviceMeshParameters, model: ModelChoice, where: str) -> None:
    """Expert parallelism under graphs needs an exchange whose sizes the host knows without reading the
    device: the capacity exchange, traced whole into the compiled block once calibrated (the reading one
    breaks each MoE block into pieces around a host read of its split sizes, and DeepEP's buffers and
    host-side handles are not measured under graphs)."""
    base, field = base_model(model)
    if not isinstance(base, BuiltinModel):
        raise ValueError(
            f"{where} with mesh.expert_parallel = {mesh.expert_parallel}: supported for the built-in "
            f"families with the capacity exchange; {field} is a plug-in, whose expert exchange the config "
            "cannot see. Use compile.mode: default"
        )
    key = f"{field}.options.parallel.expert_backend"
    backend = base.options.parallel.expert_backend
    if isinstance(backend, AllToAllBackendConfig) and backend.capacity_factor is not None:
        return
    raise ValueError(
        f"{where} with mesh.expert_parallel = {mesh.expert_parallel}: supported with {key} "
        "{kind: all_to_all, capacity_factor: <f>} (the exchange with a static capacity, whose all-to-alls "
        "are traced into the graphed block); the exchange that reads its split sizes to the host splits "
        "every MoE block around that read, and DeepEP is not measured under graphs. Set "
        f"{key}.capacity_factor (docs/parallelism.md, 'Exchange capacity') or use compile.mode: default"
    )


def cuda_graphs_hint(
    mesh: DeviceMeshParameters,
    model: ModelChoice,
    compile_config: CompileConfig,
    checkpointing: ActivationCheckpointingConfig,
    schedule_kind: str,
    *,
    evaluates: bool,
    microbatches: int,
) -> str | None:
    """A line suggesting `compile.mode: reduce-overhead` for a job in the default mode whose layout the
    config would accept with it (replicas or pipeline stages) and whose step runs several microbatches per
    rank: where the graphs were measured to pay, the GPU waiting for the host's launches. None otherwise."""
    if compile_config.mode != "default" or compile_config.backend != "inductor" or microbatches < 2:
        return None
    if mesh.data_parallel_replicate == 1 and mesh.pipeline_parallel == 1:
        return None  # one GPU accumulating small microbatches: not measured under graphs
    if mesh.expert_parallel > 1:
        return None  # accepted with the capacity exchange, but not measured at small microbatches
    graphed = compile_config.model_copy(update={"mode": "reduce-overhead"})
    try:
        check_cuda_graphs(mesh, model, graphed, checkpointing, schedule_kind, evaluates=evaluates)
    except ValueError:
        return None
    return (
        f"compile: each step runs {microbatches} microbatches per rank in a layout that accepts "
        "compile.mode: reduce-overhead (CUDA graphs of the compiled blocks). Measured on 2 x H200 against "
        "the default mode: 1.75x for replicas at four 2-sequence microbatches, 1.19-1.46x for pipeline "
        "stages under 1F1B at eight; the same speed at one 8-sequence microbatch per step; the second step "
        "records the graphs (about 20 s). docs/compile.md, 'CUDA graphs'"
    )
