"""Config-time checks of parallelism combinations, so an unsupported job fails before any process group.

Shared by training (`TrainConfig`) and inference (`InferenceConfig`); every message names the keys.
"""

from __future__ import annotations

from d9d.core.mesh_params import DeviceMeshParameters
from d9d.engine.components import (
    CausalLMTaskComponent,
    ModelPlugin,
    PerplexityTaskComponent,
    Qwen3Model,
    Qwen3MoEModel,
    TextData,
)
from d9d.engine.registry import PeftModel

_CP_KEYS = "mesh.context_parallel_shard × mesh.context_parallel_replicate"


def check_context_parallel(
    mesh: DeviceMeshParameters,
    model: Qwen3Model | Qwen3MoEModel | PeftModel | ModelPlugin,
    data: object,
    task: object,
) -> None:
    """Context parallelism (`cp` > 1) needs a model whose plan installs context-parallel attention (the
    built-in Qwen3 / Qwen3-MoE, also under PEFT) with a kernel that takes arbitrary masks, a per-token task
    (causal LM / perplexity: the batch is split along the sequence), and sequences that split into 2·cp
    chunks."""
    cp = mesh.context_parallel
    if cp == 1:
        return
    where = f"{_CP_KEYS} = {cp}"
    base, field = (
        (model.options.base, "model.options.base") if isinstance(model, PeftModel) else (model, "model")
    )
    if isinstance(base, ModelPlugin):
        raise ValueError(
            f"{where}: {field}.provider {base.provider!r} is a plug-in; context parallelism needs a "
            "model whose parallel plan installs context-parallel attention (the built-in 'qwen3' or "
            "'qwen3_moe')"
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
