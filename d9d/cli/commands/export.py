"""`d9d export RUN --hf DIR [--step N] [--merged | --adapter] [--check] [--inexact]`: a Hugging Face model
(or `peft` adapter) from a committed checkpoint of a run, on this machine's CPU, without Ray or a process
group. The checkpoint is verified against its manifest first and nothing in it is unpickled beyond plain
data; an export the format cannot hold exactly is refused unless `--inexact` (which measures the
difference); `--check` compares the export's logits in transformers with d9d's.

RUN and DIR may be storage URIs (`s3://bucket/runs/<run>`, `--storage-option endpoint_url=...`): the
checkpoint is read from the store, and an export to a URI is written to a local temporary directory first,
then copied there (weights before the JSON files that name them)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from d9d.core.storage import Location


def _run_path(run: str, options: dict[str, Any]) -> Location:
    """A run directory, a checkpoint root, a storage URI of either, or a run name under ./runs."""
    from d9d.cli.storage import open_location
    from d9d.core.storage import is_uri

    if is_uri(run):
        return open_location(run, options)
    path = Path(run)
    if path.exists() or path.is_absolute() or len(path.parts) > 1:
        return path
    return Path("runs") / run


def _occupied(dest: Location) -> bool:
    from d9d.core.storage import list_files

    return bool(list_files(dest))


def _run(args: argparse.Namespace) -> int:
    from d9d.cli.storage import open_location, storage_options
    from d9d.core.storage import StorageError
    from d9d.engine.checkpoint import CheckpointError
    from d9d.engine.errors import ConfigError
    from d9d.engine.export import (
        ExportKind,
        export_checkpoint,
        find_step,
        load_model_config,
        publish_export,
        read_train_config,
    )

    kind: ExportKind = "adapter" if args.adapter else "merged"
    try:
        options = storage_options(args.storage_options)
        dest = open_location(args.hf, options)
        if _occupied(dest) and not args.overwrite:
            print(
                f"d9d export: {dest} exists and is not empty; pass --overwrite to replace it", file=sys.stderr
            )
            return 2
        step_dir = find_step(_run_path(args.run, options), args.step)
        if args.config is not None:
            config = load_model_config(args.config, args.overrides)
        else:
            config = read_train_config(step_dir)
        options = {
            "base_model_name_or_path": args.base_model,
            "inexact": args.inexact,
            "check": args.check,
        }
        if isinstance(dest, Path):
            report = export_checkpoint(config, step_dir, dest, kind, **options)
        else:
            with tempfile.TemporaryDirectory(prefix="d9d-export-") as tmp:
                local = Path(tmp) / "export"
                report = export_checkpoint(config, step_dir, local, kind, **options)
                publish_export(local, dest)
    except (CheckpointError, ConfigError, StorageError, ValueError, FileNotFoundError) as e:
        print(f"d9d export: {e}", file=sys.stderr)
        return 2
    print(f"exported {step_dir} ({kind}) to {dest}")
    if report.gap is not None and report.drift is not None:
        print(
            f"inexact export (--inexact): {report.gap}. On a probe batch transformers' logits will differ "
            f"from d9d's: {report.drift.describe()}"
        )
    if report.check is not None:
        against = "d9d's logits without expert_bias" if report.gap is not None else "d9d's logits"
        verdict = "match" if report.check.exact else "DIFFER from"
        print(
            f"check: the exported model's logits in transformers {verdict} {against}: "
            f"{report.check.describe()}"
        )
        if not report.check.exact:
            return 1
    return 0


def register(subparsers: Any) -> None:
    from d9d.cli.storage import add_storage_option

    parser = subparsers.add_parser(
        "export", help="write a Hugging Face model or peft adapter from a committed checkpoint"
    )
    parser.add_argument(
        "run",
        help="run directory (its checkpoints/ is read), a checkpoint directory, either as a storage URI "
        "(s3://bucket/runs/<run>), or a run name under ./runs",
    )
    parser.add_argument(
        "--hf",
        required=True,
        metavar="DIR",
        help="directory or storage URI to write the Hugging Face export to",
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
        "--inexact",
        action="store_true",
        help="export even where the format cannot hold the model (Qwen3-MoE's expert_bias): the exported "
        "model's logits WILL differ from d9d's; the export prints by how much on a probe batch",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="load the merged export in transformers and compare its logits with d9d's on a probe batch "
        "(exit 1 when they differ)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the export directory when it exists and is not empty",
    )
    add_storage_option(parser)
    parser.set_defaults(handler=_run)
