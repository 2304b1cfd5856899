"""The stage backbone of a decoder-only LM: embeddings (first stage), this stage's decoder layers, final norm
(last stage). A family subclasses it with its own layers (`make_layer`) and rotary embedding."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from torch import nn

from d9d.kernels.backend import KernelBackend
from d9d.modules.attention import AttentionMask, PaddingSide, SdpaBackend, SdpaBackendName, build_sdpa_backend
from d9d.modules.base import ModuleLateInit
from d9d.modules.checkpointing import checkpointed
from d9d.modules.embedding import TokenEmbedding
from d9d.modules.norm import RMSNorm
from d9d.pipeline.api import PipelineStageInfo, balance_layers


class DecoderBackboneConfig(Protocol):
    """The config fields the shared backbone reads."""

    @property
    def splits(self) -> dict[str, int]: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def rms_norm_eps(self) -> float: ...

    @property
    def initializer_range(self) -> float: ...

    @property
    def attention_backend(self) -> SdpaBackendName: ...

    @property
    def kernel_backend(self) -> KernelBackend: ...


class DecoderBackbone(nn.Module):
    """Decoder stack for `stage`. Layers live in a `ModuleDict` keyed by their *global* index, so state-dict
    keys (`layers.17.…`) are the same whichever stage holds a layer.

    A subclass builds its rotary embedding in `make_rotary()` (a module mapping `(position_ids, dtype)` to the
    tables its layers read) and each layer in `make_layer(index, backend)`; every layer is called as
    `layer(hidden, rotary_tables, mask)`. `layer_window(index)` names a layer's sliding window (None: full).

    forward: the first stage embeds `input_ids`, later stages continue from `hidden_states`;
    `position_ids` [batch, seq] default to 0..seq-1; `attention_mask` [batch, seq] marks real tokens (1) and
    padding (0); `padding_side="right"` declares that padding only trails real tokens (what the causal-LM
    collator produces), so the batch keeps the plain causal kernel; `segment_ids` [batch, seq] confines
    attention to packed documents. The attention backend prepares the mask once per forward (dense or block
    masks for the windows this stage's layers use) and all layers share it.
    """

    def __init__(self, config: DecoderBackboneConfig, stage: PipelineStageInfo | None = None) -> None:
        super().__init__()
        self.config = config
        self.stage = stage if stage is not None else PipelineStageInfo()
        self.layer_range = balance_layers(config.num_layers, self.stage)
        backend = build_sdpa_backend(config.attention_backend)
        self.attention_backend: SdpaBackend = backend
        self.attention_windows = frozenset(self.layer_window(i) for i in self.layer_range)
        self.embed_tokens = (
            TokenEmbedding(config.splits, config.hidden_size, init_std=config.initializer_range)
            if self.stage.is_first
            else None
        )
        self.layers = nn.ModuleDict({str(i): self.make_layer(i, backend) for i in self.layer_range})
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps, backend=config.kernel_backend)
            if self.stage.is_last
            else None
        )
        self.rotary = self.make_rotary()
        self.checkpointed_layers: set[int] = set()

    def make_layer(self, index: int, backend: SdpaBackend) -> nn.Module:
        raise NotImplementedError

    def make_rotary(self) -> nn.Module:
        raise NotImplementedError

    def layer_window(self, index: int) -> int | None:
        return None

    def reset_parameters(self) -> None:
        if self.embed_tokens is not None:
            self.embed_tokens.reset_parameters()
        for layer in self.decoder_layers().values():
            assert isinstance(layer, ModuleLateInit)
            layer.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()

    def decoder_layers(self) -> Mapping[int, nn.Module]:
        """This stage's layers by global index."""
        return {int(name): layer for name, layer in self.layers.items()}

    def set_activation_checkpointing(self, enabled: bool = True, layers: Iterable[int] | None = None) -> None:
        """Recompute the given layers (default: all of this stage's) in backward instead of storing them."""
        chosen = set(self.layer_range if layers is None else layers)
        outside = sorted(chosen - set(self.layer_range))
        if outside:
            raise ValueError(f"layers {outside} are not on this stage (it holds {list(self.layer_range)})")
        self.checkpointed_layers = (
            self.checkpointed_layers | chosen if enabled else self.checkpointed_layers - chosen
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        padding_side: PaddingSide | None = None,
    ) -> torch.Tensor:
        if self.embed_tokens is not None:
            if input_ids is None:
                raise ValueError("the first pipeline stage needs input_ids")
            hidden = self.embed_tokens(input_ids)
        else:
            if hidden_states is None:
                raise ValueError(f"pipeline stage {self.stage.current_stage} needs hidden_states")
            hidden = hidden_states
        batch, seq = hidden.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device).expand(batch, seq)
        rotary = self.rotary(position_ids, hidden.dtype)
        mask = self.attention_backend.prepare(
            AttentionMask(padding=attention_mask, segment_ids=segment_ids, padding_side=padding_side),
            seq_len=seq,
            windows=self.attention_windows,
            device=hidden.device,
        )
        for index, layer in self.decoder_layers().items():
            if index in self.checkpointed_layers:
                hidden = checkpointed(layer, hidden, rotary, mask)
            else:
                hidden = layer(hidden, rotary, mask)
        if self.norm is not None:
            hidden = self.norm(hidden)
        out: torch.Tensor = hidden
        return out
