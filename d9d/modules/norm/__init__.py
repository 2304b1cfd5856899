"""Normalization layers."""

from d9d.modules.norm.rms_norm import RMSNorm

__all__ = ["RMSNorm"]
