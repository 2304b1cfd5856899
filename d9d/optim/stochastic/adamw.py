"""AdamW for bf16 parameters: fp32 math, stochastic rounding on write-back.

Round-to-nearest drops any update smaller than half a bf16 ulp (about 0.4% of the weight), so with small
learning rates bf16 weights stop moving. Stochastic rounding keeps every update in expectation, which
lets bf16 weights train like fp32 master weights without storing a second copy.

The rounding bits come from a counter-based generator keyed by `(seed, step, parameter index, element)`,
so the random state *is* the `seed` (a param-group hyperparameter) and the per-parameter `step`: both are
ordinary optimizer state, survive `torch.distributed.checkpoint` flattening and resharding, and a resumed
run reproduces bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import Optimizer, ParamsT

from d9d.kernels.stochastic_rounding import AdamWScalars, KernelBackend, RoundingStream, adamw_step
from d9d.kernels.stochastic_rounding.adamw import PARAM_DTYPES, STATE_DTYPES
from d9d.optim.stochastic.numbering import element_numbering

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class StochasticAdamW(Optimizer):
    """AdamW (decoupled weight decay) whose bf16 outputs are stochastically rounded.

    Parameters may be bf16 (rounded stochastically) or fp32 (stored exactly); `state_dtype` picks fp32 or
    bf16 moments (bf16 moments are rounded stochastically too). DTensor parameters are updated shard by
    shard with no communication. `seed` should be shared by the replicas of a parameter and differ between
    pipeline stages or other ranks holding different plain (non-DTensor) parameters.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.float32,
        seed: int = 0,
        backend: KernelBackend = "auto",
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr={lr} must be >= 0")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"betas[{i}]={beta} must be in [0, 1)")
        if not eps > 0.0:
            raise ValueError(f"eps={eps} must be > 0")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype={state_dtype} must be torch.float32 or torch.bfloat16")
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed={seed} must be in [0, 2**64)")
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend={backend!r} must be one of 'auto', 'triton', 'torch'")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "seed": seed}
        super().__init__(params, defaults)
        self.state_dtype = state_dtype
        self.backend: KernelBackend = backend
        self._numbering: dict[int, tuple[int, int]] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refuse unsupported dtypes when parameters arrive, not at the first step."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for pi, param in enumerate(params):
            if param.dtype not in PARAM_DTYPES:
                raise TypeError(
                    f"param_groups[{len(self.param_groups)}].params[{pi}] has dtype {param.dtype}; "
                    "use bfloat16 or float32"
                )
        super().add_param_group({**param_group, "params": params})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tensor_index = 0
        for gi, group in enumerate(self.param_groups):
            for pi, param in enumerate(group["params"]):
                if param.grad is not None:
                    self._update(param, group, tensor_index, f"param_groups[{gi}].params[{pi}]")
                tensor_index += 1
        return loss

    def _update(self, param: Tensor, group: dict[str, Any], tensor_index: int, where: str) -> None:
        grad = cast(Tensor, param.grad)
        if grad.is_sparse:
            raise RuntimeError(f"{where}: sparse gradients are not supported")
        if isinstance(param, DTensor) and (
            not isinstance(grad, DTensor) or tuple(grad.placements) != tuple(param.placements)
        ):
            got = grad.placements if isinstance(grad, DTensor) else "a plain tensor"
            raise RuntimeError(
                f"{where}: grad placements {got} differ from param placements {param.placements}"
            )
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0, dtype=torch.int64)
            for key in _STATE_KEYS:
                state[key] = torch.zeros_like(
                    param, dtype=self.state_dtype, memory_format=torch.preserve_format
                )
        state["step"] += 1
        step = int(state["step"])
        beta1, beta2 = group["betas"]
        scalars = AdamWScalars(
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
        )
        if id(param) not in self._numbering:
            self._numbering[id(param)] = element_numbering(param)
        first_index, shard = self._numbering[id(param)]
        stream = RoundingStream(group["seed"], step, tensor_index, first_index, shard)
        tensors = [_local(t) for t in (param, grad, state["exp_avg"], state["exp_avg_sq"])]
        dense = [t.contiguous() for t in tensors]
        adamw_step(dense[0], dense[1], dense[2], dense[3], scalars, stream, backend=self.backend)
        for original, updated in zip(tensors, dense, strict=True):
            if updated is not original:
                original.copy_(updated)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load, then restore the moments' own dtype: the base class casts them to the param dtype."""
        super().load_state_dict(state_dict)
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params, strict=True):
            saved = state_dict["state"].get(saved_id)
            if saved is None:
                continue
            for key in _STATE_KEYS:
                self.state[param][key] = saved[key].to(device=param.device, dtype=self.state_dtype, copy=True)
