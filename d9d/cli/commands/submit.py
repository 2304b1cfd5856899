"""`d9d submit CONFIG --address http://HEAD:8265`: run `d9d train` as a Ray job; prints the submission id."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def _run(args: argparse.Namespace) -> int:
    from d9d.cli import exit_codes
    from d9d.cli import main as cli
    from d9d.cli.commands.train import runtime_env_option
    from d9d.cluster.lease import LeaseHeld
    from d9d.cluster.submit import dashboard_address, submit
    from d9d.engine.config import ConfigError

    overrides = list(args.overrides)
    if args.resume_from is not None:  # travels as an override: the cluster-side `d9d train` checks it
        overrides.append(f"run.resume_from={args.resume_from}")
    try:
        sub = submit(
            args.config,
            dashboard_address(args.address),
            overrides=overrides,
            working_dir=args.working_dir,
            num_workers=args.num_workers,
            cpu=args.cpu,
            runtime_env=runtime_env_option(args),
        )
    except (ConfigError, ValueError) as e:
        print(f"d9d submit: {e}", file=sys.stderr)
        return exit_codes.REFUSED
    except LeaseHeld as e:
        print(f"d9d submit: {e}", file=sys.stderr)
        return exit_codes.LIVE_LAUNCH
    except ConnectionError as e:  # the Jobs API did not answer at that address
        hint = cli.AUTH_HINT if cli.auth_refused(e) else "is the cluster up, and is that its dashboard?"
        print(f"d9d submit: {str(e).rstrip('.')}: {hint}", file=sys.stderr)
        return exit_codes.REFUSED
    print(sub.submission_id)
    return 0


def register(subparsers: Any) -> None:
    from d9d.cli.commands.train import add_job_options

    parser = subparsers.add_parser("submit", help="submit a job to a Ray cluster through the Jobs API")
    parser.add_argument(
        "config", type=Path, help="job file (engine config plus `cluster:`), validated here before submitting"
    )
    parser.add_argument("--address", help="dashboard address, e.g. http://head:8265 (default: RAY_ADDRESS)")
    parser.add_argument("--working-dir", type=Path, help="directory uploaded with the job (default: .)")
    add_job_options(parser)
    parser.set_defaults(handler=_run)
