"""deploy/ checked: the KubeRay manifests against the RayCluster/RayJob schema subset in tests/fixtures, the
`ray up` YAML against Ray's own cluster schema (shipped in the ray package), the numbers that must agree
between them, and the Docker image's default extras. Nothing is fetched."""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from importlib.metadata import PackageNotFoundError, distribution, version
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement

from d9d.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KUBERAY_SCHEMA = json.loads((REPO / "tests" / "fixtures" / "kuberay_subset.schema.json").read_text())
# Found without importing ray (only d9d.cluster imports it).
_RAY = find_spec("ray")
assert _RAY is not None and _RAY.origin is not None
RAY_UP_SCHEMA = json.loads((Path(_RAY.origin).parent / "autoscaler" / "ray-schema.json").read_text())


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((DEPLOY / name).read_text())
    return data


def _cluster_spec(manifest: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = manifest["spec"]
    return spec["rayClusterSpec"] if manifest["kind"] == "RayJob" else spec


@pytest.mark.parametrize("name", ["kuberay/raycluster.yaml", "kuberay/rayjob.yaml"])
def test_kuberay_manifests_match_the_crd_schema(name: str) -> None:
    manifest = _load(name)
    jsonschema.validate(manifest, KUBERAY_SCHEMA)
    spec = _cluster_spec(manifest)
    # The operator's idea of the Ray version and the image's must agree (the image installs this Ray).
    assert spec["rayVersion"].split(".")[:2] == version("ray").split(".")[:2]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        pod = group["template"]["spec"]
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= volumes, (
                f"{name}: {container['name']} mounts undeclared volumes {mounts - volumes}"
            )
    # No rank on the head: the coordinator needs no CPU and is pinned there.
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for worker in spec["workerGroupSpecs"]:
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"], worker["groupName"]
        gpus = int(worker["rayStartParams"]["num-gpus"])
        limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) == gpus  # Ray schedules the GPUs the pod really has


def test_kuberay_schema_rejects_what_the_operator_would_not_take() -> None:
    """The fixture is strict where a mistake is silent on a real cluster (pruned fields, numbers where
    rayStartParams wants strings)."""
    manifest = _load("kuberay/raycluster.yaml")
    unquoted = copy.deepcopy(manifest)
    unquoted["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    misspelt = copy.deepcopy(manifest)
    misspelt["spec"]["workerGroupSpecs"][0]["maxReplica"] = 4
    for bad in (unquoted, misspelt):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, KUBERAY_SCHEMA)


def test_rayjob_entrypoint_is_a_d9d_command_reading_the_mounted_config() -> None:
    manifest = _load("kuberay/rayjob.yaml")
    argv = shlex.split(manifest["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "d9d.cli.main"]
    args = build_parser().parse_args(argv[3:])
    assert args.command == "train"
    head = manifest["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    config_mount = next(m for m in head["containers"][0]["volumeMounts"] if m["name"] == "job")
    assert args.config.parent == Path(config_mount["mountPath"])
    # Ray's job retries would start a second coordinator; d9d restarts ranks itself.
    assert manifest["spec"]["backoffLimit"] == 0


def test_ray_up_yaml_matches_rays_cluster_schema() -> None:
    config = _load("ray-up.yaml")
    jsonschema.validate(config, RAY_UP_SCHEMA)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    workers = [t for name, t in types.items() if name != config["head_node_type"]]
    assert sum(t["max_workers"] for t in workers) <= config["max_workers"]
    assert all(t["min_workers"] <= t["max_workers"] for t in workers)
    assert types[config["head_node_type"]]["resources"]["CPU"] == 0
    broken = {**config, "max_worker": 4}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, RAY_UP_SCHEMA)


def test_the_images_default_extras_install_from_the_package_index() -> None:
    """Every requirement of the Dockerfile's default EXTRAS is a published package: this environment got
    each of them from the index (`pip install .[test]`), so the image's `pip install .[EXTRAS]` does too."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    match = re.search(r"^ARG EXTRAS=(\S+)$", dockerfile, re.MULTILINE)
    assert match is not None, "deploy/Dockerfile has no ARG EXTRAS default"
    extras = match.group(1).split(",")
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) <= set(declared), f"unknown extras {set(extras) - set(declared)}"
    for extra in extras:
        for line in declared[extra]:
            requirement = Requirement(line)
            try:
                installed = distribution(requirement.name).version
            except PackageNotFoundError:
                pytest.fail(f"extra {extra!r} asks for {requirement.name}, which is not installable here")
            assert requirement.specifier.contains(installed, prereleases=True), (requirement, installed)
