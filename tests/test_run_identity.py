"""Run identity and resume semantics: a resume may change how a run is executed, never what it is; the
decision is taken on the driver before Ray is touched, and again by the engine (docs/engine.md, "Resume
semantics and checkpoint trust model")."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from d9d.engine.config import parse_config
from d9d.engine.identity import IdentityError, run_identity
from d9d.engine.resume import ResumeError, check_resume, decide_resume
from tests.harness import run_distributed
from tests.test_checkpoint_trust import STEP10, config_dict, snapshot, train

pytestmark = pytest.mark.distributed

DEMO = Path("examples") / "qwen3_moe_pretrain" / "tiny.yaml"


def _demo(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(DEMO.read_text())
    data.pop("cluster")
    for dotted, value in changes.items():
        node = data
        *parents, last = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return data


def test_identity_refuses_model_data_and_order_changes_listing_the_keys() -> None:
    base = run_identity(parse_config(_demo(), check_components=False))
    changed = run_identity(
        parse_config(
            _demo(
                model__options__architecture__hidden_size=96,
                data__options__dataset__paths=["other.txt"],
                determinism__seed=7,
            ),
            check_components=False,
        )
    )
    assert base.fingerprint != changed.fingerprint
    assert base.differences(changed) == [
        'data.options.dataset.paths: ["examples/qwen3_moe_pretrain/corpus.txt"] -> ["other.txt"]',
        "determinism.seed: 0 -> 7",
        "model.options.architecture.hidden_size: 64 -> 96",
    ]


def test_identity_allows_what_a_resume_may_change() -> None:
    base = run_identity(parse_config(_demo(), check_components=False))
    allowed = _demo(
        trainer__total_steps=400,
        mesh={"data_parallel_replicate": 1, "data_parallel_shard": 4, "expert_parallel": 2},
        batching__microbatch_size=4,
        logging__period=1,
        checkpointing__period=5,
        optimizer__options__lr=1e-3,
        lr_scheduler__options__phases=[{"kind": "rest", "target": 0.0, "curve": {"type": "linear"}}],
        gradient_clipping__max_norm=0.5,
    )
    assert run_identity(parse_config(allowed, check_components=False)).fingerprint == base.fingerprint


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("identity")
    run_distributed(train, 1, config_dict(base / "run"), "base.pt", tmp_dir=base)
    return base / "run"


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(trained, target)
    return target


def _job(run_dir: Path, **sections: Any) -> dict[str, Any]:
    return {
        **config_dict(run_dir, **sections),
        "cluster": {"num_workers": 1, "resources": {"cpus": 1, "gpus": 0}},
    }


def _forbid_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import d9d.cluster.client as client

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray was touched")

    monkeypatch.setattr(client, "connect", touched)


def test_changed_identity_is_refused_on_the_driver_before_ray(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from d9d.cluster import TrainingJob
    from d9d.cluster.spec import build_job

    _forbid_ray(monkeypatch)
    before = snapshot(run_dir)
    job = _job(
        run_dir,
        total_steps=20,
        model={"options": {"width": 8}},
        determinism={"seed": 3},
        batching={"global_batch_size": 8},
    )
    with pytest.raises(IdentityError) as error:
        TrainingJob(build_job(job)).start()
    message = str(error.value)
    assert f"{run_dir / 'checkpoints' / STEP10} belongs to a different run" in message
    for line in (
        "batching.global_batch_size: 4 -> 8",
        "determinism.seed: 0 -> 3",
        'model.options.width: "<unset>" -> 8',
    ):
        assert line in message
    assert snapshot(run_dir) == before


def test_allowed_changes_resume_on_the_engine(run_dir: Path, tmp_path: Path) -> None:
    """More steps, dp 1 -> 2, another LR and cadence: accepted by the driver and by the engine's own check."""
    changed = config_dict(
        run_dir,
        total_steps=12,
        mesh={"data_parallel_replicate": 2},
        batching={"microbatch_size": 2},
        optimizer={"options": {"lr": 5e-3}},
        checkpointing={"period": 4},
        logging={"period": 3},
    )
    decision = check_resume(parse_config(changed))
    assert (decision.action, decision.step, decision.source) == ("resume", 10, "own")
    run_distributed(train, 2, changed, "dp2.pt", tmp_dir=tmp_path)
    assert torch.load(tmp_path / "dp2.pt")["steps"] == 12
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000012"


def test_resume_never_and_required(run_dir: Path, tmp_path: Path) -> None:
    before = snapshot(run_dir)
    never = parse_config(config_dict(run_dir, total_steps=20, run={"resume": "never"}))
    with pytest.raises(
        ResumeError, match=r"run.resume=never, but .*checkpoints holds committed work .*new run.name"
    ):
        check_resume(never)
    # The engine refuses a new launch too; a restarted attempt of the same launch continues its own commits.
    own = run_dir / "checkpoints" / STEP10
    with pytest.raises(ResumeError, match=r"run\.resume=never"):
        decide_resume(never, own, new_launch=True)
    assert decide_resume(never, own, new_launch=False).action == "resume"
    assert snapshot(run_dir) == before

    empty = tmp_path / "empty"
    assert check_resume(parse_config(config_dict(empty, run={"resume": "never"}))).action == "fresh"
    with pytest.raises(ResumeError, match=r"run.resume=required, but .*empty/checkpoints holds no committed"):
        check_resume(parse_config(config_dict(empty, run={"resume": "required"})))
    required = check_resume(parse_config(config_dict(run_dir, total_steps=20, run={"resume": "required"})))
    assert (required.action, required.step) == ("resume", 10)
    assert not empty.exists()  # deciding writes nothing


def test_resume_from_starts_a_new_run_from_a_commit(run_dir: Path, tmp_path: Path) -> None:
    source = run_dir / "checkpoints" / STEP10
    before = snapshot(run_dir)
    branch = tmp_path / "branch"
    raw = config_dict(branch, total_steps=12, run={"resume_from": str(source)})
    decision = check_resume(parse_config(raw))
    assert (decision.action, decision.step_dir, decision.source) == ("resume", source, "resume_from")

    run_distributed(train, 1, raw, "branch.pt", tmp_dir=tmp_path)
    assert torch.load(tmp_path / "branch.pt")["steps"] == 12
    assert (branch / "checkpoints" / "latest").read_text() == "step-00000012"
    assert snapshot(run_dir) == before  # the source run is only read

    # Launching again with the flag is ambiguous now that the branch has commits of its own ...
    with pytest.raises(ResumeError, match=r"already holds commits of its own .*drop --resume-from"):
        check_resume(parse_config(raw))
    # ... while a restarted attempt continues from them.
    own = branch / "checkpoints" / "step-00000012"
    assert decide_resume(parse_config(raw), own, new_launch=False).step_dir == own
    # A checkpoint root is not a step; a commit of another run is refused by identity.
    root = config_dict(tmp_path / "c", run={"resume_from": str(run_dir / "checkpoints")})
    with pytest.raises(ResumeError, match=r"is not a committed step directory \(it holds commits: give one"):
        check_resume(parse_config(root))
    other = config_dict(tmp_path / "d", run={"resume_from": str(source)}, determinism={"seed": 1})
    with pytest.raises(IdentityError, match=r"determinism\.seed: 0 -> 1"):
        check_resume(parse_config(other))


def test_launching_a_finished_run_changes_nothing(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from d9d.cli.main import main as d9d_main
    from d9d.engine.launch import main as launch_main

    _forbid_ray(monkeypatch)
    before = snapshot(run_dir)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job(run_dir)))
    # `d9d train` (the Ray driver): says so, exit 5 (0 when asked: --finished-ok), Ray never started.
    assert d9d_main(["train", str(job), "--cpu"]) == 5
    assert "already finished: the newest commit" in capsys.readouterr().err
    assert d9d_main(["train", str(job), "--cpu", "--finished-ok"]) == 0
    assert "already finished: the newest commit" in capsys.readouterr().err
    # The torchrun / single-process launcher.
    assert launch_main([str(job)]) == 0
    assert "already finished" in capsys.readouterr().err
    # The engine itself (a launcher that skipped the check): reads the progress, trains and writes nothing.
    run_distributed(train, 1, config_dict(run_dir), "again.pt", tmp_dir=tmp_path)
    assert torch.load(tmp_path / "again.pt")["steps"] == 10
    assert snapshot(run_dir) == before
    # `--resume-from` into a run with commits of its own is refused with exit status 2.
    code = d9d_main(["train", str(job), "--cpu", "--resume-from", str(run_dir / "checkpoints" / STEP10)])
    assert code == 5  # the same commit as the run's own newest: nothing ambiguous, and finished
    other = run_dir / "checkpoints" / "step-00000005"
    assert d9d_main(["train", str(job), "--cpu", "--resume-from", str(other)]) == 2
    assert "drop --resume-from" in capsys.readouterr().err
    assert snapshot(run_dir) == before
