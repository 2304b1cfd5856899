"""Exports are exact or refused: Qwen3-MoE's routing bias (`expert_bias`), which Hugging Face Qwen3-MoE cannot
hold, makes `d9d export` refuse with the reason and the options; `--inexact` exports anyway and says how
much the logits differ on a probe batch (checked against transformers running the export next to d9d's
own reload of it); `--check` compares the export's logits in transformers with d9d's."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.cli.main import main
from d9d.engine.config import ConfigError, parse_config
from d9d.engine.export import export_checkpoint, find_step, probe_ids, read_train_config
from tests.harness import run_distributed
from tests.test_checkpoint_trust import config_dict, train

pytestmark = pytest.mark.distributed

MOE = {
    "vocab_size": 32,
    "hidden_size": 32,
    "num_layers": 2,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "expert_bias": True,
    "expert_bias_update_rate": 0.5,  # a bias that changes routing after a few steps
}


def _moe_job(run_dir: Path, expert_bias: bool, **checkpointing: Any) -> dict[str, Any]:
    model = {"provider": "qwen3_moe", "options": {"architecture": {**MOE, "expert_bias": expert_bias}}}
    raw = config_dict(run_dir, total_steps=3, model=model, task={"provider": "causal_lm"})
    raw["checkpointing"] = {"save_at_end": True, **checkpointing}
    return raw


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """A 3-step Qwen3-MoE run with and without expert_bias."""
    base = tmp_path_factory.mktemp("moe")
    out = {}
    for bias in (True, False):
        run_dir = base / f"bias-{bias}"
        run_distributed(train, 1, _moe_job(run_dir, bias), f"{bias}.pt", tmp_dir=base)
        out[bias] = run_dir
    return out


def test_export_refuses_a_routing_bias_the_format_cannot_hold(
    runs: dict[bool, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "hf"
    assert main(["export", str(runs[True]), "--hf", str(dest)]) == 2
    err = capsys.readouterr().err
    assert "refusing to export: the model routes with expert_bias" in err, err
    assert "logits would differ from d9d's" in err and "--inexact" in err and "expert_bias: false" in err
    assert not dest.exists()


def test_inexact_export_says_how_much_the_logits_differ_and_that_is_what_transformers_shows(
    runs: dict[bool, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers

    from d9d.models.hf import from_pretrained

    dest = tmp_path / "hf"
    assert main(["export", str(runs[True]), "--hf", str(dest), "--inexact", "--check"]) == 0
    out = capsys.readouterr().out
    assert "inexact export (--inexact): the model routes with expert_bias" in out, out
    assert "transformers' logits will differ from d9d's: max |logit difference|" in out
    assert "check: the exported model's logits in transformers match d9d's logits without expert_bias" in out

    step_dir = find_step(runs[True], None)
    report = export_checkpoint(
        read_train_config(step_dir), step_dir, tmp_path / "again", "merged", inexact=True
    )
    assert report.drift is not None and report.drift.max_abs > 1e-3  # the bias matters for this model
    # Independent reference: transformers on the export against d9d's own reload of it (which keeps the
    # bias, saved as extra tensors d9d reads back) on the same probe batch.
    ids = probe_ids(MOE["vocab_size"])
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)(
            input_ids=ids
        ).logits
        ours = from_pretrained(dest, dtype=torch.float32).eval()(input_ids=ids)["logits"]
    real = float((theirs - ours).abs().max())
    assert real == pytest.approx(report.drift.max_abs, rel=1e-3, abs=1e-5)


def test_check_passes_for_an_exact_export_and_fails_when_the_logits_differ(
    runs: dict[bool, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert main(["export", str(runs[False]), "--hf", str(tmp_path / "hf"), "--check"]) == 0
    out = capsys.readouterr().out
    assert (
        "check: the exported model's logits in transformers match d9d's logits: max |logit difference|" in out
    )

    import d9d.engine.export as export

    real = export.transformers_logits
    monkeypatch.setattr(export, "transformers_logits", lambda path, ids: real(path, ids) + 0.5)
    assert main(["export", str(runs[False]), "--hf", str(tmp_path / "hf2"), "--check"]) == 1
    assert (
        "check: the exported model's logits in transformers DIFFER from d9d's logits"
        in capsys.readouterr().out
    )


def test_the_end_of_training_export_is_refused_at_config_time_unless_asked(tmp_path: Path) -> None:
    raw = _moe_job(tmp_path / "run", True, export_hf_dir=str(tmp_path / "hf"))
    with pytest.raises(
        ConfigError,
        match=r"checkpointing.export_hf_dir: the model routes with expert_bias.*"
        r"checkpointing.export_inexact: true",
    ):
        parse_config(raw)
    raw["checkpointing"]["export_inexact"] = True
    assert parse_config(raw).checkpointing.export_inexact
    exact = _moe_job(tmp_path / "run", False, export_hf_dir=str(tmp_path / "hf"))
    assert parse_config(exact).checkpointing.export_hf_dir == tmp_path / "hf"


def test_check_does_not_apply_to_an_adapter_export(
    runs: dict[bool, Path], tmp_path: Path, capsys: Any
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(runs[False], run_dir)
    assert main(["export", str(run_dir), "--hf", str(tmp_path / "a"), "--adapter", "--check"]) == 2
    assert "does not apply to --adapter" in capsys.readouterr().err
