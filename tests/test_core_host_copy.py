"""A device tensor's copy to the host, read when needed."""

from __future__ import annotations

import pytest
import torch

from d9d.core.host_copy import HostCopy


def test_cpu_copy_is_a_snapshot() -> None:
    t = torch.arange(4.0)
    copy = HostCopy(t)
    t.add_(1)  # later changes to the source do not reach the copy
    assert copy.wait().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.gpu
def test_cuda_copy_is_pinned_and_waits_only_for_itself() -> None:
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    copy = HostCopy(t)
    t.add_(1)  # queued after the copy: the copy holds the values before it
    out = copy.wait()
    assert out.is_pinned() and out.device.type == "cpu"
    assert torch.equal(out, torch.arange(1 << 20, dtype=torch.float32))
