"""`d9d demo`: the tiny Qwen3-MoE job `make demo` runs — `d9d train` on the example's tiny config, on rank
actors of a local Ray instance, with metrics in an MLflow store under the run directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

CONFIG = Path("examples") / "qwen3_moe_pretrain" / "tiny.yaml"
RUN_NAME = "tiny-qwen3-moe"  # the config's run.name; runs land in runs/<name>


def fresh_run_name(runs: Path) -> str:
    """The demo's name, or with the first free `-<n>` suffix: a second `make demo` trains a new run
    instead of finding the first one finished (a run's committed work is never overwritten)."""
    name, n = RUN_NAME, 1
    while (runs / name).exists():
        n += 1
        name = f"{RUN_NAME}-{n}"
    return name


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.commands.train import run as train

    if not CONFIG.is_file():
        print(f"d9d demo: {CONFIG} not found; run it from the d9d repository root", file=sys.stderr)
        return 2
    overrides = list(args.overrides)
    if not any(o.startswith(("run.name=", "run.dir=")) for o in overrides):
        name = fresh_run_name(Path("runs"))
        if name != RUN_NAME:
            print(f"[d9d] demo: runs/{RUN_NAME} exists already; this run is {name}")
        overrides.append(f"run.name={name}")
    train_args = argparse.Namespace(
        config=CONFIG,
        overrides=overrides,
        address=None,
        num_workers=None,
        cpu=True,
        detach=False,
        resume_from=None,
        runtime_env=None,
        runtime_env_json=None,
        verbose=False,
        dry_run=args.dry_run,
    )
    return train(train_args)


def register(subparsers: Any) -> None:
    from d9d.cli.commands.train import add_override_option

    parser = subparsers.add_parser("demo", help="train the tiny Qwen3-MoE demo on a local Ray instance")
    add_override_option(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the demo's resolved config, layout and memory; start nothing",
    )
    parser.set_defaults(handler=_run)
