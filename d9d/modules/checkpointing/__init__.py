"""Activation checkpointing: whole-layer and op-level selective recomputation of decoder layers, and the
job's `activation_checkpointing` section."""

from d9d.modules.checkpointing.activation import (
    OP_KINDS,
    OpKind,
    PolicyApplyingForward,
    SaveOps,
    checkpointed,
    delegate_policy,
    is_recomputing,
    take_delegated_policy,
    traced_checkpoint,
    traced_context_fn,
)
from d9d.modules.checkpointing.config import (
    ActivationCheckpointingConfig,
    CheckpointableStack,
    FullActivationCheckpointing,
    NoActivationCheckpointing,
    SelectiveActivationCheckpointing,
    apply_activation_checkpointing,
    plan_layers,
)

__all__ = [
    "OP_KINDS",
    "ActivationCheckpointingConfig",
    "CheckpointableStack",
    "FullActivationCheckpointing",
    "NoActivationCheckpointing",
    "OpKind",
    "PolicyApplyingForward",
    "SaveOps",
    "SelectiveActivationCheckpointing",
    "apply_activation_checkpointing",
    "checkpointed",
    "delegate_policy",
    "is_recomputing",
    "plan_layers",
    "take_delegated_policy",
    "traced_checkpoint",
    "traced_context_fn",
]
