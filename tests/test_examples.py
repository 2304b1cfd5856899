"""Every example, run the way its README says (`python examples/<name>/run.py --small` from the repository
root) in a fresh process with a hard timeout. The scripts assert their own outcome against independent
references (transformers, peft, the loss curve) and exit non-zero otherwise; here we check the exit code
and the line each prints on success."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # each example takes well under 2 minutes on an idle 2-core machine

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def _run(script: str, *args: str, tmp_path: Path) -> str:
    """Run an example with its outputs in `tmp_path`; return its stdout."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("RAY_ADDRESS", None)  # a fresh local Ray instance, never a cluster the caller points at
    out = subprocess.run(
        [sys.executable, script, *args, "--run-dir", str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    return out.stdout


def test_perplexity(tmp_path: Path) -> None:
    out = _run("examples/perplexity/run.py", "--small", tmp_path=tmp_path)
    assert "perplexity matches transformers" in out


@pytest.mark.ray
def test_bring_your_own_model(tmp_path: Path) -> None:
    out = _run("examples/bring_your_own_model/run.py", "--small", tmp_path=tmp_path)
    assert "custom model trained on 2 rank actors: loss dropped, export reloads" in out
    assert (tmp_path / "export" / "model.safetensors").is_file()


@pytest.mark.ray
def test_interactive(tmp_path: Path) -> None:
    out = _run("examples/interactive.py", "--small", tmp_path=tmp_path)
    assert "interactive session: every transition happened" in out
    assert "started interactive-example on 2 rank actors" in out
    for transition in ("paused at step", "committed while paused", "resumed", "stopped on request"):
        assert transition in out


def test_lora_sft(tmp_path: Path) -> None:
    out = _run("examples/lora_sft/run.py", "--small", tmp_path=tmp_path)
    assert "LoRA fine-tune exported and verified" in out
    assert (tmp_path / "export" / "adapter" / "adapter_model.safetensors").is_file()
    # The script drives the Trainer itself and records the launch: `d9d list` shows how it ended.
    from d9d.cluster.registry import find_record, state_from_files

    record = find_record("lora-sft-example", run_dir=tmp_path)
    assert record is not None and record.launcher == "script"
    state = state_from_files(record)
    assert (state.state, state.step) == ("finished", 20) and state.last_loss is not None


@pytest.mark.ray
def test_qwen3_moe_pretrain(tmp_path: Path) -> None:
    out = _run("examples/qwen3_moe_pretrain/run.py", "--small", tmp_path=tmp_path)
    assert "OK: loss dropped" in out and "steps=10" in out
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000010"


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("examples/perplexity/run.py", ["--text", "nope.txt"], "--text nope.txt: no such file"),
        ("examples/perplexity/run.py", ["--checkpoint", "nope"], "--checkpoint nope: no config.json"),
        ("examples/lora_sft/run.py", ["--checkpoint", "nope"], "--checkpoint nope: no config.json"),
    ],
)
def test_a_missing_input_is_named_before_anything_starts(
    tmp_path: Path, script: str, args: list[str], message: str
) -> None:
    """A mistyped path is an argument error (exit 2, one line), not a traceback from the data provider or
    the checkpoint loader once the process group and the run directory exist."""
    out = subprocess.run(
        [sys.executable, script, *args, "--run-dir", str(tmp_path / "run")],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert out.returncode == 2, out.stdout + out.stderr[-3000:]
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "run").exists()
