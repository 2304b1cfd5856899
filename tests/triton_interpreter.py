"""Checks of Triton kernels on CPU tensors, through Triton's interpreter (CI has no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_in_interpreter(script: str) -> None:
    """Run `script` in a fresh Python with TRITON_INTERPRET=1 — Triton reads it when `@triton.jit`
    decorates, so it must be set before the kernel module imports. The script ends by printing
    `interpreter ok`, so a script that stopped early cannot pass."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "interpreter ok" in result.stdout
