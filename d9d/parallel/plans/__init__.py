"""Per-architecture parallelization plans."""

from d9d.parallel.plans.qwen3 import parallelize_qwen3, parallelize_qwen3_moe

__all__ = ["parallelize_qwen3", "parallelize_qwen3_moe"]
