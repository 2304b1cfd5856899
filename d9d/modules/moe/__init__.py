"""Mixture of Experts: router, grouped experts, communication hook, the MoE layer."""
