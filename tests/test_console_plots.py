"""The console of `d9d train` (progress line, where everything is), rank output to files, MFU, the run's
plot, `d9d plot` and `d9d lr-plot` on a job file."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest
import torch
import yaml

from d9d.cli.main import main as cli
from d9d.cluster import TrainingJob, build_job
from d9d.cluster.client import connect, disconnect
from d9d.cluster.follow import ConsoleProgress, ProgressLine, follow, format_duration
from d9d.cluster.rank import output_to_file, rank_log_path
from d9d.engine.builtin.models import builtin_provider, causal_lm_flops_per_token
from d9d.engine.providers import ModelFlops
from d9d.engine.reporting import FlopsBudget
from d9d.engine.runtime import MetricPoint, RankResult, RankRuntime, RunReporter
from d9d.engine.tracking_sink import STATE_FILE, TrackerSink
from d9d.models.qwen3 import Qwen3Config
from d9d.pipeline.api import PipelineStageInfo
from d9d.tracking import NullTracker, RunSpec
from d9d.tracking.history import read_history
from d9d.tracking.plot import plot_history
from tests.cluster_fixtures import toy_job, toy_run_rank


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_line_from_known_points() -> None:
    clock = _Clock()
    console = ConsoleProgress(total=100, clock=clock)
    gib = 2.0**30
    assert console.observe(MetricPoint(10, 0, {"cuda_max_allocated_bytes": 3 * gib}, "health")) is None
    assert console.observe(MetricPoint(10, 1, {"cuda_max_allocated_bytes": 5.5 * gib}, "health")) is None
    clock.now = 130.0  # the first train point: 30 s after the console started
    values = {"loss": 2.345678, "lr": 3e-4, "grad_norm": 1.234, "tokens_per_s": 12345.6, "mfu": 0.3821}
    first = console.observe(MetricPoint(10, 0, values, "train"))
    assert first is not None and first.eta_s is None  # one point gives no rate yet
    assert first.fields()["ETA"] == "?"
    clock.now = 150.0  # 10 more steps in 20 s: 2 s per step, 80 steps left
    line = console.observe(MetricPoint(20, 0, {**values, "loss": 2.0}, "train"))
    assert line == ProgressLine(
        step=20,
        total=100,
        elapsed_s=50.0,
        loss=2.0,
        lr=3e-4,
        grad_norm=1.234,
        tokens_per_s=12345.6,
        mfu=0.3821,
        peak_memory_bytes=5.5 * gib,
        memory_is_device=True,
        eta_s=160.0,
    )
    assert line.fields() == {
        "step": "20/100",
        "loss": "2.0000",
        "lr": "3.00e-04",
        "grad": "1.23",
        "tok/s": "12,346",
        "MFU": "38.2%",
        "mem": "5.5 GiB",
        "elapsed": "50s",
        "ETA": "2m40s",
    }
    assert line.text() == (
        "step 20/100 | loss 2.0000 | lr 3.00e-04 | grad 1.23 | tok/s 12,346 | MFU 38.2% | mem 5.5 GiB | "
        "elapsed 50s | ETA 2m40s"
    )
    # Another rank's train point, a health point and a task-metric point are no line of their own.
    assert console.observe(MetricPoint(20, 1, {"loss": 1.0}, "train")) is None
    assert console.observe(MetricPoint(20, 0, {"task/acc": 1.0}, "train")) is None
    # CPU ranks: the host's peak RSS stands in for device memory.
    cpu = ConsoleProgress(total=4, clock=clock)
    cpu.observe(MetricPoint(1, 0, {"peak_rss_bytes": 300 * 2.0**20}, "health"))
    cpu_line = cpu.observe(MetricPoint(1, 0, {"loss": 1.0}, "train"))
    assert cpu_line is not None and cpu_line.fields()["rss"] == "300.0 MiB" and "mem" not in cpu_line.fields()
    assert (format_duration(59.4), format_duration(61), format_duration(7322)) == ("59s", "1m01s", "2h02m")


def test_a_narrow_terminal_drops_whole_fields_least_telling_first() -> None:
    from rich.console import Console

    from d9d.cluster.follow import _Display

    gib = 2.0**30
    line = ProgressLine(20, 100, 50.0, 2.0, 3e-4, 1.234, 12345.6, 0.3821, 5.5 * gib, True, 160.0)
    full = line.text(with_step=False)
    assert line.fit(200, with_step=False) == full
    assert (
        line.fit(70, with_step=False) == "loss 2.0000 | lr 3.00e-04 | tok/s 12,346 | elapsed 50s | ETA 2m40s"
    )
    assert line.fit(60, with_step=False) == "loss 2.0000 | tok/s 12,346 | elapsed 50s | ETA 2m40s"
    assert line.fit(30, with_step=False) == "loss 2.0000 | ETA 2m40s"
    assert line.fit(12, with_step=False) == "loss 2.0000"
    for width in (80, 60, 40):
        out = io.StringIO()
        display = _Display(100, out, interactive=True, console=Console(file=out, width=width))
        display.step(line)
        display.close()  # off a terminal rich prints the bar's last state once, here
        (bar,) = [row for row in out.getvalue().splitlines() if row.startswith("train")]
        assert len(bar) <= width and "…" not in bar and "20/100" in bar, bar
        assert bar.rstrip().endswith("ETA 2m40s" if width >= 60 else "loss 2.0000"), bar
        shown = bar.split("20/100", 1)[1].strip().split(" | ")
        assert all(part in full.split(" | ") for part in shown), bar  # whole fields only


def test_the_plot_marks_resumes_and_restarts() -> None:
    from d9d.tracking.history import RESTART, RESUMED_FROM
    from d9d.tracking.plot import RESTART_STYLE, RESUME_STYLE, Marker, figure_of, markers

    history = {
        "train/loss": {s: 5.0 - s / 10 for s in range(1, 21)},
        RESUMED_FROM: {7: 4.0, 13: 12.0},
        RESTART: {7: 1.0, 13: 0.0},
    }
    assert markers(history) == [Marker(7, 4, restart=True), Marker(13, 12, restart=False)]
    assert [m.label for m in markers(history)] == ["restart from step 4", "resume from step 12"]
    figure = figure_of(history)
    for axes in figure.axes:  # every panel, drawn or not
        vertical = {(line.get_xdata()[0], line.get_color(), line.get_linestyle()) for line in axes.lines[-2:]}
        assert vertical == {(7, RESTART_STYLE["color"], ":"), (13, RESUME_STYLE["color"], "--")}
    legend = figure.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["train/loss", "restart", "resume"]
    assert markers({"train/loss": {1: 1.0}}) == []


def test_rank_output_goes_to_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In a rank actor sys.stdout/stderr write to file descriptors 1 and 2; pytest replaced them here.
    monkeypatch.setattr(sys, "stdout", open(1, "w", closefd=False))  # noqa: SIM115
    monkeypatch.setattr(sys, "stderr", open(2, "w", closefd=False))  # noqa: SIM115
    log = rank_log_path(tmp_path / "run", 3)
    assert log == tmp_path / "run" / "logs" / "rank3.log"
    with output_to_file(log, "---- rank 3 ----"):
        print("from python", flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        os.write(1, b"from the file descriptor\n")
        subprocess.run(["sh", "-c", "echo from a child process"], check=True)
    print("after the block")
    with output_to_file(log, "---- rank 3, again ----"):
        print("second attempt")
    assert log.read_text().splitlines() == [
        "---- rank 3 ----",
        "from python",
        "to stderr",
        "from the file descriptor",
        "from a child process",
        "---- rank 3, again ----",  # a restarted attempt appends
        "second attempt",
    ]


def test_flops_per_token_counts_the_built_models_matmuls() -> None:
    arch = {
        "vocab_size": 96,
        "hidden_size": 32,
        "num_layers": 3,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "intermediate_size": 48,
    }
    provider_class = builtin_provider("qwen3")
    provider = provider_class(provider_class.Config(architecture=arch))
    assert isinstance(provider, ModelFlops)
    with torch.device("meta"):
        module = provider.build_stage(PipelineStageInfo())
    # Every 2-D weight is a matmul a token passes through, except the embedding table (a lookup).
    matmul = sum(p.numel() for name, p in module.named_parameters() if p.dim() == 2 and "embed" not in name)
    seq = 64
    q_width = 4 * 8
    attention = 3 * 6 * q_width * seq  # 3 layers; 12·q·(T/2) per layer
    assert provider.flops_per_token(seq) == 6 * matmul + attention
    # A sliding window bounds the keys: with w = T they match the full causal count.
    windowed = Qwen3Config.model_validate({**arch, "sliding_window": seq})
    assert causal_lm_flops_per_token(windowed, seq) == provider.flops_per_token(seq)

    budget = FlopsBudget(provider.flops_per_token, sequences_per_step=8, peak_flops=4 * 1e12)
    # 8 sequences of 64 tokens in 0.5 s: 1024 tokens/s
    assert budget.mfu(1024.0, 0.5) == pytest.approx(1024.0 * provider.flops_per_token(64) / 4e12)


def test_run_plot_and_d9d_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "runs" / "curves"
    sink = TrackerSink(NullTracker(), RunSpec("curves"), run_dir / STATE_FILE, resume=False)
    for step in range(1, 21):
        values = {"loss": 3.0 / step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 + step}
        sink.write([MetricPoint(step, 0, values), MetricPoint(step, 1, {"rss_bytes": 1.0}, "health")])
    sink.write([MetricPoint(20, 0, {"loss": 0.2}, "eval")])
    sink.close("finished")
    history = read_history(run_dir / "history.jsonl")
    assert history["train/loss"] == {s: 3.0 / s for s in range(1, 21)}
    assert history["eval/loss"] == {20: 0.2}
    assert not any(name.startswith("system/") for name in history)
    png = run_dir / "plots" / "training.png"
    image = matplotlib.image.imread(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape == (640, 1000, 4)
    assert image[..., :3].std() > 0  # curves, not a blank canvas

    # `d9d plot` on the run directory, on a job file naming it, and on the run name under ./runs.
    out = tmp_path / "again.png"
    assert cli(["plot", str(run_dir), "-o", str(out)]) == 0
    assert matplotlib.image.imread(out).shape == (640, 1000, 4)
    assert "20 steps" in capsys.readouterr().out
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(toy_job("curves", run_dir)))
    png.unlink()
    assert cli(["plot", str(job)]) == 0 and png.stat().st_size > 0
    monkeypatch.chdir(tmp_path)
    assert cli(["plot", "curves", "-o", "by-name.png"]) == 0 and (tmp_path / "by-name.png").is_file()
    assert cli(["plot", "nothing-here"]) == 2
    assert "no history.jsonl in runs/nothing-here" in capsys.readouterr().err
    # A torn last line (a run killed mid-write) is skipped.
    with (run_dir / "history.jsonl").open("a") as f:
        f.write('{"step": 21, "val')
    assert read_history(run_dir / "history.jsonl")["train/loss"][20] == 3.0 / 20
    # Drawing what is there: a history with only a loss says "no data" in the other panels.
    plot_history({"train/loss": {1: 1.0}}, tmp_path / "one.png")
    assert matplotlib.image.imread(tmp_path / "one.png").shape == (640, 1000, 4)


def test_lr_plot_takes_a_job_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from d9d.optim.lr import PiecewiseScheduleConfig

    schedule = {
        "initial_multiplier": 0.0,
        "phases": [
            {"kind": "steps", "steps": 5, "target": 1.0, "curve": {"type": "linear"}},
            {"kind": "rest", "target": 0.1, "curve": {"type": "cosine"}},
        ],
    }
    job = toy_job(
        "lr",
        tmp_path / "run",
        steps=40,
        lr_scheduler={"provider": "piecewise", "options": schedule},
        optimizer={"provider": "adamw", "options": {"lr": 3e-3}},
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    out = tmp_path / "lr.png"
    assert cli(["lr-plot", str(path), "-o", str(out)]) == 0
    # The run length comes from trainer.total_steps (a `rest` phase needs it).
    expected = PiecewiseScheduleConfig.model_validate(schedule).resolve(40)
    assert capsys.readouterr().out.strip() == f"wrote {out} ({expected.end} steps, 2 phases)"
    assert expected.end == 40 and matplotlib.image.imread(out).ndim == 3

    job["lr_scheduler"]["options"]["phases"][0]["steps"] = -1
    path.write_text(yaml.safe_dump(job))
    assert cli(["lr-plot", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "lr_scheduler.options.phases.0" in err and "Traceback" not in err and "pydantic" not in err

    job["lr_scheduler"] = {"provider": "mypkg.sched:Custom"}
    path.write_text(yaml.safe_dump(job))
    assert cli(["lr-plot", str(path)]) == 2
    assert "lr_scheduler.provider: 'mypkg.sched:Custom'" in capsys.readouterr().err


# -- the whole console under Ray ------------------------------------------------------------------------


def printing_run_rank(config: dict[str, Any], runtime: RankRuntime, reporter: RunReporter) -> RankResult:
    """The toy engine, saying something first: what must land in the rank's log file, not the console."""
    print(f"hello from rank {runtime.rank}", flush=True)
    os.write(2, f"native stderr of rank {runtime.rank}\n".encode())
    return toy_run_rank(config, runtime, reporter)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_train_console_and_rank_logs_under_ray(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = toy_job(
        "console",
        run_dir,
        world=2,
        steps=4,
        cluster={"entrypoint": "tests.test_console_plots:printing_run_rank"},
        logging={"tracker": [{"kind": "log", "stdout": False}, {"kind": "tensorboard"}]},
    )
    spec = build_job(job)
    connect(local_cpus=3)
    try:
        out = io.StringIO()
        summary = follow(TrainingJob(spec).start(), out=out, interactive=False)
    finally:
        disconnect()
    assert summary.status == "finished"
    lines = out.getvalue().splitlines()
    steps = [line for line in lines if line.startswith("[d9d] step ")]
    assert [line.split(" | ")[0] for line in steps] == [f"[d9d] step {s}/4" for s in range(1, 5)]
    for line in steps:
        fields = dict(part.split(" ", 1) for part in line.removeprefix("[d9d] ").split(" | "))
        # The toy ranks report loss, lr, tokens/s and their RSS (CPU: no device memory, no MFU).
        assert set(fields) == {"step", "loss", "lr", "tok/s", "rss", "elapsed", "ETA"}
    assert not any("hello from rank" in line for line in lines)
    for rank in (0, 1):
        text = rank_log_path(run_dir, rank).read_text()
        assert f"hello from rank {rank}" in text and f"native stderr of rank {rank}" in text
        assert text.startswith(f"---- d9d rank {rank} of 2, attempt 0")
    tail = "\n".join(lines[lines.index(next(x for x in lines if "run console finished" in x)) :])
    assert f"tensorboard --logdir {run_dir.resolve() / 'tensorboard'}" in tail
    for where in (
        "checkpoints",
        "run_summary.json",
        "plots/training.png",
        "metrics.jsonl",
        "logs/rank<r>.log",
    ):
        assert where in tail, (where, tail)
    assert (run_dir / "plots" / "training.png").stat().st_size > 0
    losses = json.loads((run_dir / "run_summary.json").read_text())["losses"]
    assert read_history(run_dir / "history.jsonl")["train/loss"] == {int(k): v for k, v in losses.items()}


def test_verbose_and_tracker_preflight_on_a_job(tmp_path: Path) -> None:
    from d9d.cli.main import build_parser
    from d9d.engine.config import ConfigError

    parser = build_parser()
    assert parser.parse_args(["train", "job.yaml", "--verbose"]).verbose is True
    assert parser.parse_args(["train", "job.yaml"]).verbose is False
    assert build_job(
        toy_job("v", tmp_path / "a", cluster={"rank_output": "forward"})
    ).cluster.rank_output == ("forward")
    # A tracker that cannot open its store fails when the job is loaded, before Ray, naming both.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tb").write_text("")
    job = toy_job(
        "pre", run_dir, logging={"tracker": [{"kind": "mlflow"}, {"kind": "tensorboard", "log_dir": "tb"}]}
    )
    with pytest.raises(
        ConfigError, match=r"logging.tracker: tracker 'tensorboard' cannot open its store .*/run/tb"
    ):
        build_job(job)
    job["logging"]["tracker"] = {"kind": "aim"}
    with pytest.raises(ConfigError, match=r"logging.tracker.*'aim'"):
        build_job(job)
