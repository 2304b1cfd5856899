"""The pretraining example: the tiny job trains on 4 Ray rank actors; the GPU config validates."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from d9d.cluster import load_job


def test_gpu_config_is_valid() -> None:
    spec = load_job("examples/qwen3_moe_pretrain/gpu.yaml")
    assert spec.train.mesh.world_size == 8
    assert spec.train.schedule.kind == "zbv"


@pytest.mark.ray
def test_tiny_pretraining_example_trains() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "examples/qwen3_moe_pretrain/run.py", "--steps", "20"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "OK: loss dropped" in proc.stdout
