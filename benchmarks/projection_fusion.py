"""Would fusing the q/k/v projections (and SwiGLU's gate/up) into one matmul speed up the dense step?

    python benchmarks/projection_fusion.py [--out FILE]      # CUDA, the dense benchmark's shapes
    python benchmarks/projection_fusion.py --smoke           # CPU, tiny: the variants agree, nothing timed

1. The matmuls alone, forward + backward, bf16, 8 × 2048 tokens of hidden 1024: q/k/v (2048, 1024, 1024
   outputs) and gate/up (3072 each) as separate matmuls, as one matmul over concatenated weights, and as
   that one matmul whose output is split again (what a model does with it).
2. The model: Qwen3-0.6B's 28 decoder blocks (d9d's modules, each block compiled as the engine does; the
   embedding and final norm around them, no LM head), forward + backward of a sum-of-squares loss, with the
   projections as they are (`separate`) and with each block's weights concatenated at run time inside the
   compiled block (`qkv`, `gate_up`, `both`): the parameters, their names, sharding and checkpoints stay
   as they are, which a fused parameter would change.

Each variant's output is checked against the separate projections' before it is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from d9d.kernels.swiglu import swiglu
from d9d.models.qwen3.config import Qwen3Config
from d9d.models.qwen3.model import Qwen3Model
from d9d.modules.attention.gqa import GroupedQueryAttention
from d9d.modules.mlp import SwiGLU

VARIANTS = ("separate", "qkv", "gate_up", "both")


def _qkv_projection(self: GroupedQueryAttention, x: torch.Tensor) -> Any:
    """`GroupedQueryAttention.project_qkv` as one matmul over the concatenated weights."""
    batch, seq, _ = x.shape
    projections = (self.q_proj, self.k_proj, self.v_proj)
    fused = F.linear(x, torch.cat([p.weight for p in projections]))
    widths = [p.out_features for p in projections]
    return tuple(t.view(batch, seq, -1, self.head_dim) for t in fused.split(widths, -1))


def _gate_up_forward(self: SwiGLU, x: torch.Tensor) -> Any:
    """`SwiGLU.forward` with gate and up from one matmul over the concatenated weights."""
    gate, up = F.linear(x, torch.cat([self.gate_proj.weight, self.up_proj.weight])).chunk(2, -1)
    return self.down_proj(swiglu(gate, up, backend=self.backend))


def _median_ms(fn: Callable[[], object], steps: int, warmup: int, sync: Callable[[], None]) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def matmuls(tokens: int, hidden: int, device: torch.device, dtype: torch.dtype, steps: int) -> dict[str, Any]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict[str, Any] = {}
    for name, widths in (("qkv", [2 * hidden, hidden, hidden]), ("gate_up", [3 * hidden, 3 * hidden])):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
        weights = [torch.randn(w, hidden, device=device, dtype=dtype, requires_grad=True) for w in widths]
        fused = torch.cat(weights).detach().requires_grad_()
        grads = [torch.randn(tokens, w, device=device, dtype=dtype) for w in widths]
        grad = torch.cat(grads, 1)

        def separate(
            x: torch.Tensor = x, weights: list[torch.Tensor] = weights, grads: list[torch.Tensor] = grads
        ) -> None:
            torch.autograd.backward([x @ w.t() for w in weights], grads)

        def one(x: torch.Tensor = x, fused: torch.Tensor = fused, grad: torch.Tensor = grad) -> None:
            (x @ fused.t()).backward(grad)

        def one_split(
            x: torch.Tensor = x,
            fused: torch.Tensor = fused,
            widths: list[int] = widths,
            grads: list[torch.Tensor] = grads,
        ) -> None:
            torch.autograd.backward(list((x @ fused.t()).split(widths, dim=1)), grads)

        flops = 6 * tokens * hidden * sum(widths)
        row = {
            v: _median_ms(f, steps, 5, sync)
            for v, f in (("separate", separate), ("fused", one), ("fused_split", one_split))
        }
        out[name] = {
            **{f"{k}_ms": v for k, v in row.items()},
            **{f"{k}_tflops": flops / v / 1e9 for k, v in row.items()},
        }
    return out


def build(
    variant: str, config: Qwen3Config, device: torch.device, dtype: torch.dtype, compiled: bool
) -> Qwen3Model:
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3Model(config).to(dtype)
    for layer in model.decoder_layers().values():
        if variant in ("qkv", "both"):
            layer.self_attn.project_qkv = types.MethodType(_qkv_projection, layer.self_attn)  # type: ignore[method-assign]
        if variant in ("gate_up", "both"):
            assert isinstance(layer.mlp, SwiGLU)
            layer.mlp.forward = types.MethodType(_gate_up_forward, layer.mlp)  # type: ignore[method-assign]
        if compiled:
            layer.compile()
    return model


def blocks(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_attention_heads=args.heads, num_kv_heads=args.heads // 2, head_dim=args.hidden // 8,
        intermediate_size=3 * args.hidden,
    )  # fmt: skip
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    compiled = device.type == "cuda"
    sync = torch.cuda.synchronize if compiled else (lambda: None)
    reference: torch.Tensor | None = None
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        torch._dynamo.reset()
        model = build(variant, config, device, dtype, compiled)
        with torch.no_grad():
            hidden = model(input_ids=ids).float()
        if reference is None:
            reference = hidden
        # same weights, same math; the concatenated matmul may round differently in low precision
        error = (hidden - reference).abs().max().item() / reference.abs().max().item()

        def step(model: Qwen3Model = model) -> None:
            model(input_ids=ids).float().square().mean().backward()

        start = time.perf_counter()
        step()
        sync()
        first = time.perf_counter() - start
        out[variant] = {
            "relative_error": error,
            "first_step_s": first,
            "median_ms": _median_ms(step, args.steps, 3, sync) if not args.smoke else None,
        }
        print(json.dumps({variant: out[variant]}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, float32, nothing timed")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.__dict__.update(vocab=64, hidden=32, layers=2, heads=4, batch=2, seq=16)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("projection_fusion.py needs CUDA (or --smoke)")
        device, dtype = torch.device("cuda"), torch.bfloat16
        args.__dict__.update(vocab=151936, hidden=1024, layers=28, heads=16, batch=8, seq=2048)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if not args.smoke:
        result["matmuls"] = matmuls(args.batch * args.seq, args.hidden, device, dtype, args.steps * 3)
        print(json.dumps(result["matmuls"]), flush=True)
    result["blocks"] = blocks(args, device, dtype)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
