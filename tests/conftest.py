from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def _ray() -> Iterator[None]:
    """A local Ray instance with 3 CPUs for one test module (`@pytest.mark.usefixtures("_ray")`)."""
    import ray

    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


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
