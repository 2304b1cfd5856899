"""The cost model of a decoder LM: training FLOPs per token (MFU) and a stage's memory footprint (dry run).

FLOPs: 6 × the matmul parameters a token passes through (MoE: the routed experts and the router only; the
LM head, tied or not; embedding lookups and norms are free) plus the attention scores: per layer
3 (forward + backward) × 2 (multiply-add) × (score width + value width) × the keys a query sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from d9d.models.decoder.tasks import DecoderStageModel
from d9d.models.family import StageFootprint
from d9d.modules.moe import GroupedExperts, TopKRouter
from d9d.pipeline.partition import StageCosts


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer's per-token FLOP inputs.

    - `matmul_params`: the matmul parameters a token passes through.
    - `score_width`: heads × the query/key head dim (the QK^T product width).
    - `value_width`: heads × the value head dim (the AV product width).
    - `window`: the layer's sliding window, None for full causal attention.
    """

    matmul_params: int
    score_width: int
    value_width: int
    window: int | None = None


def mean_attended_keys(seq_len: int, window: int | None) -> float:
    """Keys a query sees, on average over the sequence: T/2 under the causal mask, about w (1 - w/2T) with a
    sliding window w < T."""
    if window is None or window >= seq_len:
        return seq_len / 2
    return window * (1 - window / (2 * seq_len))


def decoder_stage_costs(
    vocab_size: int, hidden_size: int, layers: Iterable[LayerCost], seq_len: int
) -> StageCosts:
    """Training FLOPs per token of the embedding (none: lookups), each layer and the LM head, for pipeline
    stages of equal cost (`d9d.pipeline.split`)."""
    per_layer = tuple(
        6.0 * layer.matmul_params
        + 6 * (layer.score_width + layer.value_width) * mean_attended_keys(seq_len, layer.window)
        for layer in layers
    )
    return StageCosts(0.0, per_layer, 6.0 * vocab_size * hidden_size)


def decoder_flops_per_token(
    vocab_size: int, hidden_size: int, layers: Iterable[LayerCost], seq_len: int
) -> float:
    return decoder_stage_costs(vocab_size, hidden_size, layers, seq_len).total


def decoder_footprint(
    module: nn.Module,
    activation_values: Callable[[int, nn.Module], int],
    *,
    loss_chunk_size: int,
    vocab_size: int,
    op_values: Callable[[int, nn.Module], int] | None = None,
) -> StageFootprint | None:
    """The dry run's view of a decoder stage: the plan of `parallelize_decoder` splits every matrix but the
    experts' and the routers' over tp; `activation_values(index, layer)` is what a layer keeps per token;
    `op_values(index, layer)` what it keeps under op-level selective checkpointing (its matmul and attention
    outputs; None: not modelled); a checkpointed layer keeps its input (`hidden_size` values); the last stage
    holds one float32 loss chunk."""
    if not isinstance(module, DecoderStageModel):
        return None
    kept = {p for m in module.modules() if isinstance(m, GroupedExperts | TopKRouter) for p in m.parameters()}
    tensor_parallel = frozenset(p for p in module.parameters() if p.dim() >= 2 and p not in kept)
    layers = module.model.decoder_layers()
    values = {i: activation_values(i, layer) for i, layer in layers.items()}
    ops = None if op_values is None else {i: op_values(i, layer) for i, layer in layers.items()}
    chunk = (loss_chunk_size, vocab_size) if module.stage.is_last else None
    return StageFootprint(tensor_parallel, values, chunk, module.model.config.hidden_size, ops)
