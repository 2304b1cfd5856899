"""What the catalogue's decoder-only language models share: the pipeline-stage backbone plumbing, the task
heads, the parallelization plan of a pre-norm attention + feed-forward layer, and the cost model. A family
composes these with its own layers (`d9d/models/<family>/layer.py`)."""

from d9d.models.decoder.backbone import DecoderBackbone, DecoderBackboneConfig
from d9d.models.decoder.cost import (
    LayerCost,
    decoder_flops_per_token,
    decoder_footprint,
    decoder_stage_costs,
    mean_attended_keys,
)
from d9d.models.decoder.layer import PreNormDecoderLayer
from d9d.models.decoder.plan import PreNormLayer, parallelize_decoder, tensor_parallel_prenorm_layer
from d9d.models.decoder.tasks import (
    BackboneInputs,
    DecoderForCausalLM,
    DecoderForEmbedding,
    DecoderForSequenceClassification,
    DecoderStageModel,
    DecoderTaskConfig,
)

__all__ = [
    "BackboneInputs",
    "DecoderBackbone",
    "DecoderBackboneConfig",
    "DecoderForCausalLM",
    "DecoderForEmbedding",
    "DecoderForSequenceClassification",
    "DecoderStageModel",
    "DecoderTaskConfig",
    "LayerCost",
    "PreNormDecoderLayer",
    "PreNormLayer",
    "decoder_flops_per_token",
    "decoder_footprint",
    "decoder_stage_costs",
    "mean_attended_keys",
    "parallelize_decoder",
    "tensor_parallel_prenorm_layer",
]
