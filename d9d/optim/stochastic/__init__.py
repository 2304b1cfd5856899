"""Optimizers that keep low-precision parameters trainable through stochastic rounding."""

from d9d.optim.stochastic.adamw import StochasticAdamW

__all__ = ["StochasticAdamW"]
