"""Profiling: torch.profiler traces for a window of training steps, one file per rank."""

from d9d.profiling.step_profiler import NullProfiler, StepHook, StepProfiler

__all__ = ["NullProfiler", "StepHook", "StepProfiler"]
