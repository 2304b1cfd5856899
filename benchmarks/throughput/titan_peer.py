"""torchtitan 0.2.2 rows: its own Qwen3 / Qwen3-MoE / Llama 3 model, parallelized (and, with compile,
per-block compiled) by its own `parallelize_qwen3` / `parallelize_llama`, loss from its own
`build_cross_entropy_loss` (compiled with the model when compile is on). Only the loop is ours: no
torchtitan trainer, config file or download.

torchtitan's defaults that would make the comparison unequal are switched off or matched: activation
checkpointing (default `selective`) is off unless the row asks for a mode (`common.TITAN_AC_MODES`: `full`,
`selective` = its `selective_ac_option: "2"`, `selective-op` = `"op"`; d9d's `selective-mix` has no
torchtitan counterpart), parameters are bf16 (single GPU, no FSDP mixed precision), buffers such as the RoPE
cache stay fp32 as torchtitan keeps them. The MoE's aux-loss-free bias update, which torchtitan's trainer
hooks into its optimizer, is not run (a few tiny kernels per step; the routing itself is unchanged).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

from throughput.common import ARCHS, BATCH, LLAMA3_ROPE, LR, SEQ, TITAN_AC_MODES, AcMode, summary, time_loop


def _stub_unused_imports() -> None:
    """torchtitan's model packages import its trainer's metrics logger (TensorBoard) and HF dataset loader at
    module level; this loop uses neither, so where those packages are missing, empty stand-ins let the model
    import. Installed packages are used as they are."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        tensorboard = types.ModuleType("torch.utils.tensorboard")
        tensorboard.SummaryWriter = object  # type: ignore[attr-defined]
        sys.modules["torch.utils.tensorboard"] = tensorboard
    try:
        import datasets
        import datasets.distributed  # noqa: F401
    except ImportError:
        stub = types.ModuleType("datasets")
        stub.Dataset = stub.load_dataset = object  # type: ignore[attr-defined]
        distributed = types.ModuleType("datasets.distributed")
        distributed.split_dataset_by_node = object  # type: ignore[attr-defined]
        sys.modules.update({"datasets": stub, "datasets.distributed": distributed})


def model_args(arch: dict[str, Any], seq_len: int = SEQ) -> Any:
    """torchtitan's `Qwen3ModelArgs` for a benchmark shape (`common.ARCHS`): untied; an MoE shape (one with
    `num_experts`) routes as torchtitan's own Qwen3-MoE 30B-A3B entry spells it."""
    _stub_unused_imports()
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    return Qwen3ModelArgs(
        dim=arch["hidden_size"],
        n_layers=arch["num_layers"],
        n_heads=arch["num_attention_heads"],
        n_kv_heads=arch["num_kv_heads"],
        vocab_size=arch["vocab_size"],
        head_dim=arch["head_dim"],
        hidden_dim=arch["intermediate_size"],
        rope_theta=1_000_000,
        qk_norm=True,
        max_seq_len=seq_len,
        enable_weight_tying=False,
        moe_enabled="num_experts" in arch,
        moe_inter_dim=arch.get("moe_intermediate_size", 768),
        moe_args=MoEArgs(
            num_experts=arch.get("num_experts", 8),
            num_shared_experts=0,
            top_k=arch.get("num_experts_per_tok", 1),
            score_func="softmax",
            route_norm=True,
            route_scale=1.0,
            score_before_experts=False,
        ),
    )


def llama3_model_args(arch: dict[str, Any], seq_len: int = SEQ) -> Any:
    """torchtitan's llama3 `TransformerModelArgs` for the Llama-3.2-1B shape: head_dim = dim / n_heads, and
    its SwiGLU width int(2 · 4·dim / 3) × 1.5 rounded up to 256 = 8192 = `intermediate_size`."""
    _stub_unused_imports()
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    assert arch["hidden_size"] // arch["num_attention_heads"] == arch["head_dim"]
    args = TransformerModelArgs(
        dim=arch["hidden_size"],
        n_layers=arch["num_layers"],
        n_heads=arch["num_attention_heads"],
        n_kv_heads=arch["num_kv_heads"],
        vocab_size=arch["vocab_size"],
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=LLAMA3_ROPE["rope_theta"],
        rope_scaling_args=RoPEScalingArgs(
            scaling_factor=LLAMA3_ROPE["factor"],
            low_freq_factor=LLAMA3_ROPE["low_freq_factor"],
            high_freq_factor=LLAMA3_ROPE["high_freq_factor"],
            original_max_position_embeddings=LLAMA3_ROPE["original_max_position_embeddings"],
        ),
        max_seq_len=seq_len,
    )
    hidden = int(args.ffn_dim_multiplier * int(2 * 4 * args.dim / 3))
    assert args.multiple_of * -(-hidden // args.multiple_of) == arch["intermediate_size"]
    return args


def deepseek_v3_model_args(arch: dict[str, Any], seq_len: int = SEQ) -> Any:
    """torchtitan's `DeepSeekV3ModelArgs` for `common.DEEPSEEK_V3`, routed as its own 671B entry spells
    DeepSeek-V3 (sigmoid scores, renormalized top-k, weights applied after the experts, group-limited),
    grouped-mm experts, and FlexAttention, which every DeepSeek entry of torchtitan's but its debug model
    uses (its SDPA wrapper allows only the cuDNN, flash and math kernels, and MLA's 192-dim keys beside
    128-dim values can leave it only math), with the plain causal mask (random tokens hold no documents).

    `load_balance_coeff=None`: no expert-bias buffer, like d9d's row with `expert_bias` off, since this loop
    does not run the trainer's optimizer hook that would update it. `moe_impl` is what the trainer's
    `update_from_config` sets from a default job (the standard MoE, not DeepEP); this loop never calls that
    method, whose other effects (sequence length, grouped mm on SM90) are set here directly."""
    _stub_unused_imports()
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    if arch["expert_bias"]:
        raise ValueError("the torchtitan row runs no expert-bias update; give the shape expert_bias: false")
    groups = arch["num_expert_groups"]
    args = DeepSeekV3ModelArgs(
        max_seq_len=seq_len,
        vocab_size=arch["vocab_size"],
        dim=arch["hidden_size"],
        inter_dim=arch["intermediate_size"],
        moe_inter_dim=arch["moe_intermediate_size"],
        n_layers=arch["num_layers"],
        n_dense_layers=arch["first_k_dense"],
        n_heads=arch["num_attention_heads"],
        moe_args=MoEArgs(
            num_experts=arch["num_experts"],
            num_shared_experts=arch["num_shared_experts"],
            score_func="sigmoid",
            route_norm=arch["norm_topk_prob"],
            route_scale=arch["routed_scaling_factor"],
            score_before_experts=False,
            top_k=arch["num_experts_per_tok"],
            num_expert_groups=groups if groups > 1 else None,
            num_limited_groups=arch["topk_groups"] if groups > 1 else None,
            use_grouped_mm=True,
            load_balance_coeff=None,
        ),
        q_lora_rank=arch["q_lora_rank"] or 0,  # torchtitan's 0 is d9d's None: one full query projection
        kv_lora_rank=arch["kv_lora_rank"],
        qk_nope_head_dim=arch["qk_nope_head_dim"],
        qk_rope_head_dim=arch["qk_rope_head_dim"],
        v_head_dim=arch["v_head_dim"],
        attn_type="flex",
        attn_mask_type="causal",
        rope_theta=arch["rope_theta"],
    )
    args.moe_impl = "standard"
    # YaRN (and its softmax-scale correction) applies only past original_seq_len; d9d's row has plain RoPE
    assert args.max_seq_len <= args.original_seq_len
    return args


def deepseek_v3_model_class() -> type[torch.nn.Module]:
    """torchtitan's `DeepSeekV3Model`, callable as the loop calls every model (`net(ids)`): given no masks,
    it builds the causal `BlockMask` its FlexAttention needs with the model's own `get_attention_masks`, as
    torchtitan's trainer does before every step (the causal mask type reads no tokenizer)."""
    _stub_unused_imports()
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model

    class CausalDeepSeekV3Model(DeepSeekV3Model):  # type: ignore[misc]
        def forward(
            self, tokens: torch.Tensor, attention_masks: Any = None, positions: torch.Tensor | None = None
        ) -> torch.Tensor:
            if attention_masks is None and self.model_args.attn_type == "flex":
                attention_masks = self.get_attention_masks(tokens, tokenizer=None)
            out: torch.Tensor = super().forward(tokens, attention_masks, positions)
            return out

    return CausalDeepSeekV3Model


def activation_checkpoint(job: Any, ac: AcMode) -> None:
    """torchtitan's `--activation_checkpoint.mode` and `--activation_checkpoint.selective_ac_option`."""
    match ac:
        case "none" | "full":
            job.activation_checkpoint.mode = ac
        case "selective":
            job.activation_checkpoint.mode = "selective"
            job.activation_checkpoint.selective_ac_option = "2"
        case "selective-op":
            job.activation_checkpoint.mode = "selective"
            job.activation_checkpoint.selective_ac_option = "op"
        case "selective-mix":
            # `--titan-ac` does not offer it (`common.TITAN_AC_MODES`); a row spec given by hand ends here
            raise ValueError(
                "torchtitan has no activation checkpointing that mixes whole-layer and op-level "
                f"recomputation (`selective-mix`): its rows take {', '.join(TITAN_AC_MODES)}"
            )


def build_model(
    model: str, compiled: bool, device: torch.device | None = None, ac: AcMode = "none"
) -> tuple[Any, Any]:
    _stub_unused_imports()
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims

    if model == "llama3":
        from torchtitan.models.llama3 import Transformer as Qwen3Model
        from torchtitan.models.llama3 import parallelize_llama as parallelize_qwen3

        args = llama3_model_args(ARCHS[model])
    elif model == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import parallelize_deepseekv3 as parallelize_qwen3

        Qwen3Model = deepseek_v3_model_class()  # noqa: N806 (the name the shared code below builds)
        args = deepseek_v3_model_args(ARCHS[model])
    else:
        from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3

        args = model_args(ARCHS[model])
    job = JobConfig()
    job.training.seq_len = SEQ
    activation_checkpoint(job, ac)
    job.compile.enable = compiled
    job.compile.components = ["model", "loss"]
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Qwen3Model(args)
    parallelize_qwen3(net, dims, job)
    device = device or torch.device("cuda")
    net.to_empty(device=device)
    with torch.no_grad():
        net.init_weights(buffer_device=device)
        for p in net.parameters():
            p.data = p.data.to(torch.bfloat16)
    return net.train(), build_cross_entropy_loss(job)


def run(
    model: str, compiled: bool, steps: int, warmup: int, ac: AcMode = "none", profiled: int = 0
) -> dict[str, Any]:
    net, loss_fn = build_model(model, compiled, ac=ac)
    optimizer = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)

    def step(ids: torch.Tensor) -> float:
        # torchtitan's loss is a sum; its trainer divides by the global count of target tokens.
        loss = loss_fn(net(ids[:, :-1]), ids[:, 1:]) / (BATCH * SEQ)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    timed = time_loop(step, warmup, steps, ARCHS[model]["vocab_size"], profiled)
    result = summary(timed["times"], timed["first_step_s"], model)
    if profiled:
        result["profile"] = timed["profile"]
    return result
