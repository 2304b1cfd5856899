"""Autograd extensions for pipelining: backward split into an input pass and a deferred weight pass."""

from d9d.pipeline.autograd.split_backward import DeferredWeightGrad, backward_input

__all__ = ["DeferredWeightGrad", "backward_input"]
