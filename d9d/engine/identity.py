"""Run identity: what a checkpoint may be resumed into.

A run is its model, its data and the order the data comes in, and its optimizer. Those config parts are
flattened to dotted keys and hashed (sha256 over canonical JSON); every commit stores the result in
`identity.json` beside its other files (covered by the manifest's hashes). A resume with a different
identity is refused with the differing keys listed.

Everything else may change on resume: total steps, the LR scheduler (the schedule beyond the current step),
the base learning rate (also changeable live), the mesh and data-parallel degree (DCP reshards), the
microbatch size, gradient clipping and sync, compilation, logging, profiling, timeouts, checkpoint cadence
and the cluster section. So may the model's parallelization plan (`model.options.parallel`), which lays out
the same weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from d9d.core.storage import Location
from d9d.engine.config import TrainConfig

IDENTITY_FILE = "identity.json"

# Whole sections that define the run ...
_SECTIONS = ("model", "data", "task", "optimizer")
# ... single keys of other sections: the data order depends on the global batch and the seed.
_KEYS = ("batching.global_batch_size", "determinism.seed")


def _excluded(key: str) -> bool:
    """Keys inside the identity sections that a resume may still change."""
    if key == "optimizer.options.lr":
        return True  # the schedule's base value; `update(lr=...)` changes it live as well
    parts = key.split(".")
    # How the model is parallelized (also inside a peft wrapper's inner model section).
    return parts[0] == "model" and any(
        parts[i] == "options" and parts[i + 1] == "parallel" for i in range(len(parts) - 1)
    )


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to JSON leaves; an empty mapping or list is kept as a leaf so its presence counts."""
    if isinstance(tree, Mapping) and tree:
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


@dataclass(frozen=True)
class RunIdentity:
    values: dict[str, Any]  # dotted key -> JSON value

    @property
    def fingerprint(self) -> str:
        canonical = json.dumps(self.values, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def to_json(self) -> str:
        return json.dumps({"fingerprint": self.fingerprint, "values": self.values}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: Location) -> RunIdentity:
        try:
            data = json.loads(text)
            values = data["values"]
            if not isinstance(values, dict):
                raise TypeError("values is not a mapping")
        except (ValueError, KeyError, TypeError) as e:
            raise IdentityError(f"{source} is not a run identity file: {e}") from None
        identity = cls(dict(values))
        if data.get("fingerprint") != identity.fingerprint:
            raise IdentityError(f"{source}: the fingerprint does not match its values")
        return identity

    def differences(self, other: RunIdentity) -> list[str]:
        """`key: old -> new` lines, `self` being the checkpoint's identity and `other` the new config's."""
        lines = []
        for key in sorted(self.values.keys() | other.values.keys()):
            old, new = self.values.get(key, "<unset>"), other.values.get(key, "<unset>")
            if old != new:
                lines.append(f"{key}: {json.dumps(old)} -> {json.dumps(new)}")
        return lines


class IdentityError(ValueError):
    """A resume into a config that is not the same run; the message lists the differing dotted keys."""


def run_identity(config: TrainConfig) -> RunIdentity:
    dumped = config.model_dump(mode="json")
    values: dict[str, Any] = {}
    for section in _SECTIONS:
        values.update(flatten(dumped.get(section), section))
    flat_all = flatten(dumped)
    for key in _KEYS:
        values[key] = flat_all.get(key)
    return RunIdentity({k: v for k, v in values.items() if not _excluded(k)})


def read_identity(step_dir: Location) -> RunIdentity | None:
    """The identity a commit was written under, or None for a commit from before identities existed."""
    path = step_dir / IDENTITY_FILE
    if not path.is_file():
        return None
    return RunIdentity.from_json(path.read_text(), path)


def check_identity(step_dir: Location, config: TrainConfig) -> RunIdentity | None:
    """Raise `IdentityError` listing the keys where `config` differs from the run `step_dir` belongs to;
    return the stored identity (None when the commit has none)."""
    stored = read_identity(step_dir)
    if stored is None:
        return None
    current = run_identity(config)
    if stored.fingerprint != current.fingerprint:
        diff = stored.differences(current)
        raise IdentityError(
            f"{step_dir} belongs to a different run: resuming would change what defines it "
            f"(model, data and its order, optimizer):\n  " + "\n  ".join(diff) + "\n"
            "Restore these settings to continue the run, or start a new one (another run.name or run.dir; "
            "--resume-from PATH starts a new run from a committed step of the same identity)."
        )
    return stored
