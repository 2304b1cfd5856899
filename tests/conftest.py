from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not torch.cuda.is_available():
        skip_gpu = pytest.mark.skip(reason="needs CUDA; runs on the device machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip_gpu)
        return
    present = torch.cuda.device_count()
    for item in items:
        marker = item.get_closest_marker("gpus")
        if marker is not None and present < marker.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {marker.args[0]} GPUs, found {present}"))
