"""Hugging Face transformers rows: plain, with Liger kernels, and with `torch.compile` of the whole model.

The model computes its own (shifted) loss from `labels`, as a transformers user would train it; Liger's
fused linear cross-entropy replaces that loss so full-vocabulary logits are never materialized.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from throughput.common import ARCHS, LLAMA3_ROPE, LR, SEQ, summary, time_loop

HfVariant = Literal["plain", "liger", "compile"]


def build_model(model: str) -> Any:
    import transformers

    if model == "deepseek_v3":  # the peer for this shape is torchtitan's own deepseek_v3
        raise ValueError("no transformers row for the DeepSeek-V3 shape: run it with --peers d9d,torchtitan")
    arch = ARCHS[model]
    common = {
        "vocab_size": arch["vocab_size"],
        "hidden_size": arch["hidden_size"],
        "num_hidden_layers": arch["num_layers"],
        "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_kv_heads"],
        "head_dim": arch["head_dim"],
        "intermediate_size": arch["intermediate_size"],
        "tie_word_embeddings": False,
        "max_position_embeddings": SEQ,
    }
    torch.manual_seed(0)
    with torch.device("cuda"):
        if model == "moe":
            config = transformers.Qwen3MoeConfig(
                **common,
                moe_intermediate_size=arch["moe_intermediate_size"],
                num_experts=arch["num_experts"],
                num_experts_per_tok=arch["num_experts_per_tok"],
            )
            net = transformers.Qwen3MoeForCausalLM(config)
        elif model == "llama3":
            rope = {"rope_type": "llama3", **LLAMA3_ROPE}
            net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_parameters=rope))
        else:
            net = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    return net.to(dtype=torch.bfloat16).train()


def apply_liger(model: str, net: Any) -> None:
    from liger_kernel.transformers import (
        apply_liger_kernel_to_llama,
        apply_liger_kernel_to_qwen3,
        apply_liger_kernel_to_qwen3_moe,
    )

    kernels = {"rope": True, "rms_norm": True, "swiglu": True, "fused_linear_cross_entropy": True}
    match model:
        case "moe":
            apply_liger_kernel_to_qwen3_moe(model=net, **kernels)
        case "llama3":
            apply_liger_kernel_to_llama(model=net, **kernels)
        case _:
            apply_liger_kernel_to_qwen3(model=net, **kernels)


def run(model: str, variant: HfVariant, steps: int, warmup: int) -> dict[str, Any]:
    net = build_model(model)
    match variant:
        case "plain":
            forward = net
        case "liger":
            apply_liger(model, net)
            forward = net
        case "compile":
            forward = torch.compile(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)

    def step(ids: torch.Tensor) -> float:
        inputs = ids[:, :-1]
        loss = forward(input_ids=inputs, labels=inputs).loss  # transformers shifts the labels itself
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    timed = time_loop(step, warmup, steps, ARCHS[model]["vocab_size"])
    return summary(timed["times"], timed["first_step_s"], model)
