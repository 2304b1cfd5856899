"""`d9d export RUN --hf DIR [--step N] [--merged | --adapter]`: a Hugging Face model (or `peft` adapter)
from a committed checkpoint of a run, on this machine's CPU, without Ray or a process group."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _run_path(run: str) -> Path:
    """A run directory, a checkpoint root, or a run name under ./runs."""
    path = Path(run)
    if path.exists() or path.is_absolute() or len(path.parts) > 1:
        return path
    return Path("runs") / run


def _run(args: argparse.Namespace) -> int:
    from d9d.engine.checkpoint import CheckpointError
    from d9d.engine.config import ConfigError, load_config
    from d9d.engine.export import ExportKind, export_checkpoint, find_step, read_train_config

    dest: Path = args.hf
    if dest.exists() and any(dest.iterdir()) and not args.overwrite:
        print(f"d9d export: {dest} exists and is not empty; pass --overwrite to replace it", file=sys.stderr)
        return 2
    kind: ExportKind = "adapter" if args.adapter else "merged"
    try:
        step_dir = find_step(_run_path(args.run), args.step)
        if args.config is not None:
            config = load_config(args.config, args.overrides, ignore_sections=["cluster"])
        else:
            config = read_train_config(step_dir)
        export_checkpoint(config, step_dir, dest, kind, base_model_name_or_path=args.base_model)
    except (CheckpointError, ConfigError, ValueError, FileNotFoundError) as e:
        print(f"d9d export: {e}", file=sys.stderr)
        return 2
    print(f"exported {step_dir} ({kind}) to {dest}")
    return 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export", help="write a Hugging Face model or peft adapter from a committed checkpoint"
    )
    parser.add_argument(
        "run",
        help="run directory (its checkpoints/ is read), a checkpoint directory, or a run name under ./runs",
    )
    parser.add_argument(
        "--hf", type=Path, required=True, metavar="DIR", help="directory to write the Hugging Face export to"
    )
    parser.add_argument(
        "--step", type=int, help="the committed step to export (default: the latest committed one)"
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--merged",
        action="store_true",
        help="full model weights with PEFT adapters folded in, loadable by transformers (the default)",
    )
    what.add_argument(
        "--adapter",
        action="store_true",
        help="only the PEFT adapter (adapter_config.json + adapter_model.safetensors), for the peft library",
    )
    parser.add_argument(
        "--base-model",
        metavar="NAME_OR_PATH",
        help="base model the adapter names in adapter_config.json (default: the base's source_checkpoint)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="job file to rebuild the model from, for checkpoints saved without train_config.json "
        "(default: the config saved with the checkpoint)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of --config by its dotted path (value parsed as YAML); repeatable",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the export directory when it exists and is not empty",
    )
    parser.set_defaults(handler=_run)
