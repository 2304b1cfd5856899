"""Task models over a decoder backbone: causal LM, sequence classification, embeddings. Each is pipeline-stage
aware; a family names its backbone (`backbone_class`) and inherits the rest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypedDict, Unpack

import torch
from torch import nn

from d9d.models.decoder.backbone import DecoderBackbone
from d9d.modules.attention import PaddingSide
from d9d.modules.base import ModuleLateInit
from d9d.modules.heads import CausalLMHead, EmbeddingHead, Pooling, SequenceClassificationHead
from d9d.pipeline.api import PipelineStageInfo, TensorMeta


class DecoderTaskConfig(Protocol):
    """The config fields the task heads read."""

    @property
    def splits(self) -> dict[str, int]: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def initializer_range(self) -> float: ...

    @property
    def loss_chunk_size(self) -> int: ...

    @property
    def tie_word_embeddings(self) -> bool: ...


class BackboneInputs(TypedDict, total=False):
    """What a stage's backbone reads (`DecoderBackbone.forward`); the task models add their labels."""

    input_ids: torch.Tensor | None
    hidden_states: torch.Tensor | None
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    segment_ids: torch.Tensor | None
    padding_side: PaddingSide | None


class DecoderStageModel(nn.Module):
    """What every task model shares: the backbone for its stage and the stage-boundary contract.

    A non-last stage returns `{"hidden_states": ...}` for the next stage; the last stage returns the
    head's outputs. `activation_dtype` overrides the dtype declared for stage boundaries when compute runs
    in another dtype than the parameters (mixed precision); by default it is the parameters' dtype.
    """

    backbone_class: ClassVar[type[DecoderBackbone]]

    def __init__(self, config: Any, stage: PipelineStageInfo | None = None) -> None:
        super().__init__()
        self.config = config
        self.stage = stage if stage is not None else PipelineStageInfo()
        self.model = self.backbone_class(config, self.stage)
        self.activation_dtype: torch.dtype | None = None

    def head(self) -> ModuleLateInit | None:
        """The task head (on the last stage only; None elsewhere)."""
        return None

    def head_outputs(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The last stage's outputs from the backbone's final hidden states."""
        raise NotImplementedError

    def reset_parameters(self) -> None:
        self.model.reset_parameters()
        head = self.head()
        if head is not None:
            head.reset_parameters()

    def forward(
        self, *, labels: torch.Tensor | None = None, **inputs: Unpack[BackboneInputs]
    ) -> dict[str, torch.Tensor]:
        hidden: torch.Tensor = self.model(**inputs)
        if self.head() is None:
            return {"hidden_states": hidden}
        return self.head_outputs(hidden, inputs.get("attention_mask"), labels)

    def stage_output_meta(self, microbatch_inputs: Mapping[str, torch.Tensor]) -> dict[str, TensorMeta]:
        if self.stage.is_last:
            return {}
        batch, seq = microbatch_inputs["input_ids"].shape[:2]
        dtype = self.activation_dtype or next(self.model.parameters()).dtype
        return {"hidden_states": TensorMeta((batch, seq, self.config.hidden_size), dtype)}


class DecoderForCausalLM(DecoderStageModel):
    """Last stage: `{"logits": [batch, seq, vocab]}` without labels, `{"loss": [batch, seq]}` (float32
    per-token loss, 0 where the label is -100) with labels. Labels are aligned with positions:
    `labels[:, t]` is the token that should follow position t (shift once in the data pipeline)."""

    def __init__(self, config: Any, stage: PipelineStageInfo | None = None) -> None:
        super().__init__(config, stage)
        self.lm_head: CausalLMHead | None = None
        if self.stage.is_last:
            self.lm_head = CausalLMHead(
                config.hidden_size,
                config.splits,
                init_std=config.initializer_range,
                loss_chunk_size=config.loss_chunk_size,
            )
            if config.tie_word_embeddings:
                if self.model.embed_tokens is None:
                    raise ValueError(
                        "tie_word_embeddings needs the embeddings and the head on one stage, but they are "
                        f"split over {self.stage.num_stages} pipeline stages"
                    )
                self.lm_head.tie_to(self.model.embed_tokens)

    def head(self) -> ModuleLateInit | None:
        return self.lm_head

    def head_outputs(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        assert self.lm_head is not None
        if labels is None:
            return {"logits": self.lm_head(hidden)}
        return {"loss": self.lm_head(hidden, labels)}


class DecoderForSequenceClassification(DecoderStageModel):
    """Last stage: `{"logits": [batch, num_labels]}`, or `{"loss": [batch]}` with labels."""

    def __init__(
        self,
        config: Any,
        num_labels: int,
        stage: PipelineStageInfo | None = None,
        *,
        pooling: Pooling = "last",
    ) -> None:
        super().__init__(config, stage)
        self.score = (
            SequenceClassificationHead(
                config.hidden_size, num_labels, pooling=pooling, init_std=config.initializer_range
            )
            if self.stage.is_last
            else None
        )

    def head(self) -> ModuleLateInit | None:
        return self.score

    def head_outputs(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        assert self.score is not None
        out = self.score(hidden, attention_mask, labels)
        return {"logits": out} if labels is None else {"loss": out}


class DecoderForEmbedding(DecoderStageModel):
    """Last stage: `{"embeddings": [batch, dim]}` (pooled, optionally projected and L2-normalized)."""

    def __init__(
        self,
        config: Any,
        stage: PipelineStageInfo | None = None,
        *,
        pooling: Pooling = "last",
        projection_dim: int | None = None,
        normalize: bool = True,
    ) -> None:
        super().__init__(config, stage)
        self.embedding_head = (
            EmbeddingHead(
                config.hidden_size,
                pooling=pooling,
                projection_dim=projection_dim,
                normalize=normalize,
                init_std=config.initializer_range,
            )
            if self.stage.is_last
            else None
        )

    def head(self) -> ModuleLateInit | None:
        return self.embedding_head

    def head_outputs(
        self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        assert self.embedding_head is not None
        if labels is not None:
            raise ValueError(
                "an embedding model takes no labels; compute the contrastive loss on its outputs"
            )
        return {"embeddings": self.embedding_head(hidden, attention_mask)}
