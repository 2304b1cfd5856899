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
    _group_for_xdist(items)
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


def _group_for_xdist(items: list[pytest.Item]) -> None:
    """Work units for `pytest -n N --dist loadgroup` (what `make test` runs): every test that starts Ray
    in one unit, so the Ray instances, `ray start --head` clusters and their timing-sensitive fault
    scenarios run one at a time on one worker; every other test with the rest of its file, so a file's
    module-scoped fixtures are built once. Without xdist the marks are inert."""
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
