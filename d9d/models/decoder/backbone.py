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
from d9d.modules.checkpointing import SaveOps, checkpointed, delegate_policy
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
        # global layer index -> its op-level policy (None: the whole layer is recomputed)
        self.checkpointed_layers: dict[int, SaveOps | None] = {}

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

    def set_activation_checkpointing(
        self, enabled: bool = True, layers: Iterable[int] | None = None, *, policy: SaveOps | None = None
    ) -> None:
        """Recompute the given layers (default: all of this stage's) in backward instead of storing them; with
        `policy`, keep the outputs of the ops it names and recompute the rest (op-level selective). The job's
        `activation_checkpointing` section sets this through `apply_activation_checkpointing`."""
        chosen = set(self.layer_range if layers is None else layers)
        outside = sorted(chosen - set(self.layer_range))
        if outside:
            raise ValueError(f"layers {outside} are not on this stage (it holds {list(self.layer_range)})")
        for index in sorted(chosen):
            if enabled:
                self.checkpointed_layers[index] = policy
            else:
                self.checkpointed_layers.pop(index, None)

    def _run_layer(
        self, index: int, layer: nn.Module, hidden: torch.Tensor, rotary: object, mask: AttentionMask
    ) -> torch.Tensor:
        if index not in self.checkpointed_layers or not torch.is_grad_enabled():
            out: torch.Tensor = layer(hidden, rotary, mask)  # nothing is kept without autograd
            return out
        policy = self.checkpointed_layers[index]
        if policy is not None and getattr(layer.forward, "applies_checkpoint_policy", False):
            # a compiled block traces the checkpoint itself, so the compiler applies the policy (around the
            # compiled call, torch's selective modes would only see the compiled code's opaque kernels)
            with delegate_policy(policy):
                out = layer(hidden, rotary, mask)
            return out
        # whole-layer: around the block call (its hooks and, when compiled, the compiled forward)
        return checkpointed(layer, hidden, rotary, mask, policy=policy)

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
            hidden = self._run_layer(index, layer, hidden, rotary, mask)
        if self.norm is not None:
            hidden = self.norm(hidden)
        out: torch.Tensor = hidden
        return out
