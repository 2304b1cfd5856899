"""The pretraining example's GPU config validates. The tiny job itself (run.py on 4 Ray rank actors, the
loss must drop) is run by tests/test_examples.py::test_qwen3_moe_pretrain, the way its README says."""

from __future__ import annotations

from d9d.cluster import load_job


def test_gpu_config_is_valid() -> None:
    spec = load_job("examples/qwen3_moe_pretrain/gpu.yaml")
    assert spec.train.mesh.world_size == 8
    assert spec.train.schedule.kind == "zbv"
