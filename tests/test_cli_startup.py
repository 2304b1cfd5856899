"""What the everyday commands import before they do anything: `d9d --help`, every `d9d <cmd> --help`, and
`d9d list/status/logs/plot` of runs in a local runs directory import neither torch nor Ray (nor, for help,
pydantic or numpy). Measured as the modules loaded, not as a time: a time depends on the machine's load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "ray", "pydantic", "numpy", "matplotlib", "transformers", "mlflow", "yaml")

_PROBE = """
import contextlib, io, json, sys
from d9d.cli.main import build_parser, main
heavy = {heavy!r}
out = {{}}
argvs = {argvs!r}
if argvs is None:
    commands = [a for a in build_parser()._subparsers._group_actions[0].choices]
    argvs = [["--help"]] + [[c, "--help"] for c in commands]
for argv in argvs:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    out[" ".join(argv)] = {{"code": code, "stdout": buffer.getvalue()}}
out["imported"] = sorted(m for m in heavy if m in sys.modules)
print(json.dumps(out))
"""


def _probe(argvs: list[list[str]] | None, cwd: Path) -> dict:
    script = _PROBE.format(heavy=HEAVY, argvs=argvs)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_help_of_every_command_imports_nothing_heavy(tmp_path: Path) -> None:
    out = _probe(None, tmp_path)
    imported = out.pop("imported")
    assert imported == [], f"printing help imported {imported}"
    assert "train" in out["--help"]["stdout"] and "status" in out["--help"]["stdout"]
    commands = {argv.split()[0] for argv in out if argv != "--help"}
    assert {"train", "status", "list", "logs", "plot", "export", "submit", "stop", "resume"} <= commands
    for argv, result in out.items():
        assert result["code"] == 0, argv
        assert "usage: d9d" in result["stdout"], argv


def _local_run(root: Path, name: str) -> Path:
    run = root / name
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank0.log").write_text("hello from rank 0\n")
    lines = [{"step": s, "t": 1000.0 + s, "values": {"train/loss": 5.0 - s / 10}} for s in (1, 2, 3)]
    (run / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = {"run_name": name, "status": "finished", "steps": 3, "restarts": 0, "final_loss": 4.7}
    (run / "run_summary.json").write_text(json.dumps({**summary, "launches": [summary]}))
    return run


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["list"], "finished"),
        (["status", "local-run"], "run local-run: finished"),
        (["logs", "local-run"], "hello from rank 0"),
        (["plot", "local-run", "-o", "curves.png"], "wrote curves.png"),
    ],
)
def test_local_lookups_import_neither_torch_nor_ray(tmp_path: Path, argv: list[str], expected: str) -> None:
    _local_run(tmp_path / "runs", "local-run")
    out = _probe([argv], tmp_path)
    imported = out.pop("imported")
    assert "torch" not in imported and "ray" not in imported, f"{argv} imported {imported}"
    (result,) = out.values()
    assert result["code"] == 0 and expected in result["stdout"], result
