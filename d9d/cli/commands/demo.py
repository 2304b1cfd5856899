"""`d9d demo`: the tiny Qwen3-MoE job `make demo` runs — `d9d train` on the example's tiny config, on rank
actors of a local Ray instance, with metrics in an MLflow store under the run directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

CONFIG = Path("examples") / "qwen3_moe_pretrain" / "tiny.yaml"


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.commands.train import run as train

    if not CONFIG.is_file():
        print(f"d9d demo: {CONFIG} not found; run it from the d9d repository root", file=sys.stderr)
        return 2
    train_args = argparse.Namespace(
        config=CONFIG,
        overrides=args.overrides,
        address=None,
        num_workers=None,
        cpu=True,
        detach=False,
        resume_from=None,
        verbose=False,
    )
    return train(train_args)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="train the tiny Qwen3-MoE demo on a local Ray instance")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.set_defaults(handler=_run)
