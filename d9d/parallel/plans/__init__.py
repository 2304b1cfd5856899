"""The options of a model family's parallelization plan. The plans themselves live with their families
(`d9d.models.<family>`, built on `d9d.models.decoder.parallelize_decoder`), which compose the per-layer
strategies of this package."""

from d9d.parallel.plans.config import ParallelPlanConfig

__all__ = ["ParallelPlanConfig"]
