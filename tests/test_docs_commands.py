"""The `d9d ...` commands the quickstart and the performance page show are real: each command line of their
shell blocks parses with `d9d`'s own parser (subcommand, flags, their values), and each `d9d ...` in their
prose names real subcommands and real flags of them. Runs in `make test`; it imports no torch and starts
nothing."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from d9d.cli.main import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "docs" / "quickstart.md", REPO / "docs" / "performance.md"]
_FENCE = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)
_SPAN = re.compile(r"`(?:[A-Z_][A-Z0-9_]*=\S* )*(d9d [^`]+)`")
_ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
_COMMAND_LINE = re.compile(r"^(\$ )?([A-Z_][A-Z0-9_]*=\S* )*d9d( |$)")


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _words(line: str) -> list[str]:
    words = shlex.split(line, comments=True)
    while words and _ENV.match(words[0]):  # PYTHONPATH=. d9d submit ...
        words.pop(0)
    return words


def block_commands(text: str) -> list[str]:
    """Every `d9d ...` command line of the shell blocks (continuations joined)."""
    found = []
    for lang, body in _FENCE.findall(text):
        if lang not in ("bash", "sh", "shell", ""):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if _COMMAND_LINE.match(line.strip()):
                found.append(shlex.join(_words(line.strip().removeprefix("$ "))))
    return found


def span_commands(text: str) -> list[str]:
    prose = _FENCE.sub("", text)
    return [m.group(1) for m in _SPAN.finditer(prose)]


def test_the_extraction_finds_the_commands() -> None:
    text = (
        "Run `d9d status RUN --json`, then:\n\n```bash\nPYTHONPATH=. d9d train job.yaml \\\n"
        "    --set a=1   # a comment\nmake demo\n```\n"
    )
    assert block_commands(text) == ["d9d train job.yaml --set a=1"]
    assert span_commands(text) == ["d9d status RUN --json"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_shell_command_of_the_docs_parses(doc: Path) -> None:
    commands = block_commands(doc.read_text())
    assert commands, f"no d9d commands found in {doc}"
    parser = build_parser()
    for command in commands:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                args = parser.parse_args(shlex.split(command)[1:])
            except SystemExit:
                pytest.fail(f"{doc.name}: `{command}` does not parse: {err.getvalue().strip()}")
        assert getattr(args, "handler", None) is not None, command


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_in_the_prose_names_real_subcommands_and_flags(doc: Path) -> None:
    commands = _subcommands()
    spans = span_commands(doc.read_text())
    assert spans, f"no `d9d ...` in the prose of {doc}"
    for span in spans:
        words = span.replace("[", " ").replace("]", " ").split()
        if len(words) < 2 or words[1].isupper():  # `d9d COMMAND --help`: a placeholder
            continue
        names = re.split(r"[/|]", words[1])
        for name in names:
            assert name in commands, f"{doc.name}: `{span}`: no subcommand {name!r}"
        flags = {w.split("=", 1)[0] for w in words[2:] if re.fullmatch(r"--?[a-z][\w-]*(=.*)?", w)}
        for name in names:
            known = set(commands[name]._option_string_actions)
            missing = flags - known
            assert not missing, f"{doc.name}: `{span}`: d9d {name} has no {sorted(missing)}"
