"""Balance statistics of a model's MoE layers, as flat `name → float` metrics for the engine to log.

Per layer and step, compact: the expert load relative to its mean (max, min and the 10/50/90%
quantiles; 1.0 everywhere is perfect balance) and the balancing loss averaged over the step's forwards.
The full per-expert histogram (token copies per expert) only every `histogram_period` steps.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from d9d.modules.moe.layer import MoELayer

_QUANTILES = (0.1, 0.5, 0.9)


def moe_layers(modules: Iterable[nn.Module]) -> list[tuple[str, MoELayer]]:
    """Every MoE layer of `modules` (e.g. a rank's pipeline stages) with its qualified name."""
    return [(name, m) for module in modules for name, m in module.named_modules() if isinstance(m, MoELayer)]


def expert_load_metrics(layer: str, load: torch.Tensor, *, histogram: bool = False) -> dict[str, float]:
    """`load` [experts]: token copies per expert of one layer (summed over the ranks that saw different
    tokens). Empty when the layer saw no tokens."""
    values = load.detach().double().cpu()
    mean = float(values.mean())
    if mean <= 0:
        return {}
    ratio = values / mean
    out = {
        f"moe/{layer}/max_load_ratio": float(ratio.max()),
        f"moe/{layer}/min_load_ratio": float(ratio.min()),
    }
    quantiles = torch.quantile(ratio, torch.tensor(_QUANTILES, dtype=torch.float64))
    out |= {
        f"moe/{layer}/load_q{round(q * 100)}": float(v) for q, v in zip(_QUANTILES, quantiles, strict=True)
    }
    if histogram:
        width = len(str(values.numel() - 1))
        out |= {f"moe/{layer}/tokens/e{e:0{width}d}": float(v) for e, v in enumerate(values.tolist())}
    return out


AuxLossStats = list[tuple[str, torch.Tensor]]
"""Per MoE layer that ran a training forward: its name and balancing-loss [sum, forward calls]."""


def take_aux_loss_stats(layers: Iterable[tuple[str, MoELayer]]) -> AuxLossStats:
    """Each layer's balancing-loss statistics since the last call, as they are (on the device: nothing is
    read), and reset."""
    out: AuxLossStats = []
    for name, layer in layers:
        stats = layer.aux_loss_stats
        layer.reset_aux_loss_stats()
        if stats is not None:
            out.append((name, stats.detach()))
    return out


def aux_loss_metrics(stats: AuxLossStats) -> dict[str, float]:
    """The balancing loss of each layer averaged over its forwards, and their mean over layers as
    `moe/aux_loss` (one read of every layer's statistics)."""
    if not stats:
        return {}
    values = torch.stack([s.double() for _, s in stats]).cpu().tolist()
    out = {
        f"moe/{name}/aux_loss": total / calls
        for (name, _), (total, calls) in zip(stats, values, strict=True)
        if calls > 0
    }
    if out:
        out["moe/aux_loss"] = sum(out.values()) / len(out)
    return out


def take_aux_loss_metrics(layers: Iterable[tuple[str, MoELayer]]) -> dict[str, float]:
    """The balancing loss of each layer averaged over its forwards since the last call (then reset), and
    their mean over layers as `moe/aux_loss`. Layers that ran no training forward are left out."""
    return aux_loss_metrics(take_aux_loss_stats(layers))


class MoEMetrics:
    """Writes one step's MoE metrics into a metrics dict that lives across steps: histogram keys of an
    earlier histogram step are removed on the steps in between, so a logged value is never stale."""

    def __init__(self, modules: Iterable[nn.Module], *, histogram_period: int = 100) -> None:
        if histogram_period < 1:
            raise ValueError(f"histogram_period={histogram_period} must be >= 1")
        self.layers = moe_layers(modules)
        self.histogram_period = histogram_period

    def record(
        self,
        metrics: dict[str, float],
        loads: Mapping[str, torch.Tensor],
        step: int,
        aux_stats: AuxLossStats | None = None,
    ) -> None:
        """`loads`: MoE layer name → its (reduced) expert load for the step just finished; `aux_stats`: the
        layers' balancing-loss statistics taken at that step (`take_aux_loss_stats`; None takes them now)."""
        histogram = step % self.histogram_period == 0
        for key in [k for k in metrics if k.startswith("moe/") and "/tokens/e" in k]:
            del metrics[key]
        for layer, load in loads.items():
            metrics.update(expert_load_metrics(layer, load, histogram=histogram))
        metrics.update(aux_loss_metrics(take_aux_loss_stats(self.layers) if aux_stats is None else aux_stats))
