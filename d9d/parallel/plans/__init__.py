"""Per-architecture parallelization plans."""

from d9d.parallel.plans.config import ParallelPlanConfig
from d9d.parallel.plans.qwen3 import parallelize_qwen3, parallelize_qwen3_moe

__all__ = ["ParallelPlanConfig", "parallelize_qwen3", "parallelize_qwen3_moe"]
