"""`cluster.runtime_env`: what Ray sets up on every node before the run's coordinator and rank actors start
(local packages, a working directory, pip packages, environment variables).

The keys are a subset of Ray's own `runtime_env` and mean the same. When d9d joins Ray (`d9d train`,
`TrainingJob.start`, `connect`) it becomes the driver's job-level runtime env, which every actor of the
driver inherits, the coordinator and through it the ranks. Ray uploads local directories only at that
level: a driver that called `ray.init` itself must pass them there (an env of remote URIs, pip and env
vars only is put on the coordinator instead). `d9d submit` makes it the Ray job's runtime env.

Local paths are resolved against the working directory of the process that loads the job file and must
exist there; they are uploaded by Ray from that process. The driver checks the job (it imports the
entrypoint and, with the built-in engine, the plug-ins) before anything starts, so while it does, the
local `py_modules` and `working_dir` are put on its own `sys.path` the way Ray puts them on the workers'
(`import_paths`): a plug-in package needs no second install on the driver's machine.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from d9d.engine.config import MAX_CONFIG_BYTES, ConfigError, format_validation_error, load_yaml

# Files Ray accepts as a py_modules entry besides a package directory.
_MODULE_FILES = (".whl", ".zip")


def _is_uri(value: str) -> bool:
    """Remote packages (`s3://…/pkg.zip`, `https://…`) are fetched by Ray on each node, not checked here."""
    return "://" in value


class RuntimeEnvConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Package directories (`import <dir name>` works on the workers), .whl/.zip files, or remote URIs.
    py_modules: list[str] = Field(default_factory=list)
    # Uploaded and made the workers' current directory (and first on their sys.path).
    working_dir: str | None = None
    # Requirement strings installed into a virtual environment on each node (needs network there).
    pip: list[str] = Field(default_factory=list)
    env_vars: dict[str, str] = Field(default_factory=dict)
    # gitignore-style patterns left out of the `working_dir` and `py_modules` uploads.
    excludes: list[str] = Field(default_factory=list)

    @field_validator("py_modules")
    @classmethod
    def _check_modules(cls, values: list[str]) -> list[str]:
        resolved = []
        for i, value in enumerate(values):
            if _is_uri(value):
                resolved.append(value)
                continue
            path = Path(value).expanduser().resolve()
            if not path.exists():
                raise ValueError(f"py_modules[{i}]: {value} does not exist ({path})")
            if path.is_file() and path.suffix not in _MODULE_FILES:
                raise ValueError(
                    f"py_modules[{i}]: {value} is a file; give a package directory or a .whl/.zip"
                )
            resolved.append(str(path))
        return resolved

    @field_validator("working_dir")
    @classmethod
    def _check_working_dir(cls, value: str | None) -> str | None:
        if value is None or _is_uri(value):
            return value
        path = Path(value).expanduser().resolve()
        if not (path.is_dir() or (path.is_file() and path.suffix == ".zip")):
            raise ValueError(f"{value} is neither a directory nor a .zip file ({path})")
        return str(path)

    @property
    def empty(self) -> bool:
        return not (self.py_modules or self.working_dir or self.pip or self.env_vars or self.excludes)

    def to_ray(self) -> dict[str, Any]:
        """The `runtime_env` dict Ray takes (set fields only)."""
        return {k: v for k, v in self.model_dump(mode="json").items() if v}

    def local_fields(self) -> list[str]:
        """The fields naming local paths (Ray uploads those only for a job-level runtime env)."""
        fields = ["py_modules"] if any(not _is_uri(m) for m in self.py_modules) else []
        if self.working_dir is not None and not _is_uri(self.working_dir):
            fields.append("working_dir")
        return fields

    def import_paths(self) -> list[str]:
        """What the workers' sys.path gains from the local entries: a package directory's parent, the
        working directory itself."""
        paths = [str(Path(m).parent) for m in self.py_modules if not _is_uri(m) and Path(m).is_dir()]
        if self.working_dir is not None and not _is_uri(self.working_dir) and Path(self.working_dir).is_dir():
            paths.append(self.working_dir)
        return paths


def parse_runtime_env(data: Mapping[str, Any], source: str) -> RuntimeEnvConfig:
    try:
        return RuntimeEnvConfig.model_validate(dict(data))
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, prefix=source)) from None


def read_runtime_env(path: Path) -> dict[str, Any]:
    """A `--runtime-env` file (YAML or JSON); relative paths in it stay relative to the working directory,
    as with the job file."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"--runtime-env {path}: more than {MAX_CONFIG_BYTES:,} bytes; refused")
        data = load_yaml(path.read_text(), f"--runtime-env {path}")
    except OSError as e:
        raise ConfigError(f"--runtime-env {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--runtime-env {path}: not UTF-8 text: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--runtime-env {path}: expected a mapping of runtime_env keys")
    return data


def parse_runtime_env_json(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--runtime-env-json: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError("--runtime-env-json: expected a JSON object of runtime_env keys")
    return data


def merge_runtime_env(base: RuntimeEnvConfig, extra: RuntimeEnvConfig) -> RuntimeEnvConfig:
    """`extra` over `base`: lists are joined (first occurrence kept), env_vars merged key by key with
    `extra` winning, `working_dir` replaced when `extra` sets one."""

    def join(a: list[str], b: list[str]) -> list[str]:
        return list(dict.fromkeys([*a, *b]))

    return RuntimeEnvConfig.model_validate(
        {
            "py_modules": join(base.py_modules, extra.py_modules),
            "working_dir": extra.working_dir or base.working_dir,
            "pip": join(base.pip, extra.pip),
            "env_vars": {**base.env_vars, **extra.env_vars},
            "excludes": join(base.excludes, extra.excludes),
        }
    )


def with_runtime_env(data: Mapping[str, Any], extra: RuntimeEnvConfig | None) -> dict[str, Any]:
    """A job file's data with `extra` (the command line's `--runtime-env*`) merged over its
    `cluster.runtime_env`."""
    out = dict(data)
    if extra is not None:
        cluster = dict(out.get("cluster") or {})
        base = parse_runtime_env(cluster.get("runtime_env") or {}, "cluster.runtime_env")
        cluster["runtime_env"] = merge_runtime_env(base, extra).model_dump(mode="json")
        out["cluster"] = cluster
    return out


@contextlib.contextmanager
def import_paths(env: RuntimeEnvConfig | None) -> Iterator[None]:
    """The driver's imports see the runtime environment's local packages while checking the job; its own
    sys.path is restored afterwards (modules imported meanwhile stay imported)."""
    if env is None:
        yield
        return
    added = [p for p in env.import_paths() if p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for path in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(path)
