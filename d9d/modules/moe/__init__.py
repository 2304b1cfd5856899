"""Mixture of Experts: router, grouped experts, communication hook, the MoE layer."""

from d9d.modules.moe.aux_loss import attach_auxiliary_loss, load_balancing_loss
from d9d.modules.moe.communication import DispatchedTokens, MoECommunication, RoutedTokens
from d9d.modules.moe.counting import tokens_per_expert
from d9d.modules.moe.experts import GroupedExperts
from d9d.modules.moe.grouped_mm import (
    GROUPED_MM_ENV,
    AutoGroupedMM,
    EagerGroupedMM,
    GroupedGemmMM,
    GroupedMM,
    GroupedMMName,
    TorchGroupedMM,
    build_grouped_mm,
)
from d9d.modules.moe.layer import MoELayer
from d9d.modules.moe.local_communication import LocalMoECommunication
from d9d.modules.moe.router import Routing, ScoreFunction, TopKRouter, route_topk
from d9d.modules.moe.stats import (
    MoEMetrics,
    expert_load_metrics,
    moe_layers,
    take_aux_loss_metrics,
    take_aux_loss_stats,
)

__all__ = [
    "GROUPED_MM_ENV",
    "AutoGroupedMM",
    "DispatchedTokens",
    "EagerGroupedMM",
    "GroupedExperts",
    "GroupedGemmMM",
    "GroupedMM",
    "GroupedMMName",
    "LocalMoECommunication",
    "MoECommunication",
    "MoELayer",
    "MoEMetrics",
    "RoutedTokens",
    "Routing",
    "ScoreFunction",
    "TopKRouter",
    "TorchGroupedMM",
    "attach_auxiliary_loss",
    "build_grouped_mm",
    "expert_load_metrics",
    "load_balancing_loss",
    "moe_layers",
    "route_topk",
    "take_aux_loss_metrics",
    "take_aux_loss_stats",
    "tokens_per_expert",
]
