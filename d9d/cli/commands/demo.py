"""`d9d demo`: the tiny Qwen3-MoE job `make demo` runs."""

from __future__ import annotations

import argparse
from typing import Any


def _run(args: argparse.Namespace) -> int:
    print("demo arrives with the engine and cluster layers")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="train the tiny Qwen3-MoE demo on a local Ray instance")
    parser.set_defaults(handler=_run)
