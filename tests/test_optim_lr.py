from __future__ import annotations

import io
import json
import math
import struct
import zlib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from d9d.cli.main import main as cli_main
from d9d.optim.lr import (
    CosineCurve,
    ExponentialCurve,
    LinearCurve,
    PiecewiseLR,
    PiecewiseScheduleConfig,
    PolynomialCurve,
    build_piecewise_lr,
    piecewise_schedule,
)

WARMUP_COSINE = {
    "initial_multiplier": 0.0,
    "phases": [
        {"kind": "steps", "steps": 100, "target": 1.0, "curve": {"type": "linear"}},
        {"kind": "percentage", "until": 0.9, "target": 0.1, "curve": {"type": "cosine"}},
        {"kind": "rest", "target": 0.0},
    ],
}


def _optimizer(*base_lrs: float) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in base_lrs]
    return torch.optim.SGD(groups, lr=1.0)


def test_builder_and_config_build_the_same_schedule() -> None:
    built = (
        piecewise_schedule(initial_multiplier=0.0)
        .for_steps(100, 1.0, curve="linear")
        .until_percentage(0.9, 0.1, curve="cosine")
        .fill_rest(0.0)
    )
    config = PiecewiseScheduleConfig.model_validate(WARMUP_COSINE)
    assert built.config() == config
    assert built.resolve(1000) == config.resolve(1000)


def test_values_at_phase_boundaries() -> None:
    schedule = PiecewiseScheduleConfig.model_validate(WARMUP_COSINE).resolve(1000)
    assert [(s.start, s.end) for s in schedule.segments] == [(0, 100), (100, 900), (900, 1000)]
    expected = {0: 0.0, 50: 0.5, 100: 1.0, 500: 0.55, 900: 0.1, 950: 0.05, 1000: 0.0, 5000: 0.0}
    for step, value in expected.items():
        assert schedule.multiplier(step) == pytest.approx(value, abs=1e-12), step


@pytest.mark.parametrize(
    ("curve", "closed_form"),
    [
        (LinearCurve(), lambda a, b, t: a + (b - a) * t),
        (CosineCurve(), lambda a, b, t: b + 0.5 * (a - b) * (1 + math.cos(math.pi * t))),
        (ExponentialCurve(), lambda a, b, t: math.exp(math.log(a) + (math.log(b) - math.log(a)) * t)),
        (PolynomialCurve(power=2.0), lambda a, b, t: b + (a - b) * (1 - t) ** 2),
        (PolynomialCurve(power=0.5), lambda a, b, t: b + (a - b) * math.sqrt(1 - t)),
    ],
    ids=["linear", "cosine", "exponential", "poly2", "poly0.5"],
)
def test_each_curve_matches_its_closed_form(curve, closed_form) -> None:
    start, end, steps = 0.8, 0.02, 37
    schedule = piecewise_schedule(initial_multiplier=start).for_steps(steps, end, curve=curve).resolve()
    for step in range(steps + 3):
        t = min(step, steps) / steps
        assert schedule.multiplier(step) == pytest.approx(closed_form(start, end, t), rel=1e-12, abs=1e-15)


def test_percentage_rounds_to_nearest_step_and_steps_only_needs_no_total() -> None:
    schedule = piecewise_schedule(1.0).until_percentage(0.333, 0.5).fill_rest(0.25).resolve(10)
    assert [(s.start, s.end) for s in schedule.segments] == [(0, 3), (3, 10)]
    steps_only = piecewise_schedule(0.0).for_steps(10, 1.0).for_steps(5, 1.0).resolve()
    assert steps_only.end == 15
    assert steps_only.multiplier(12) == 1.0


def test_zero_length_phase_jumps_to_its_target() -> None:
    schedule = piecewise_schedule(1.0).for_steps(10, 1.0).fill_rest(0.5).resolve(10)
    assert schedule.multiplier(9) == 1.0
    assert schedule.multiplier(10) == 0.5


def _error(payload: dict, total_steps: int | None = None) -> str:
    with pytest.raises((ValidationError, ValueError)) as info:
        PiecewiseScheduleConfig.model_validate(payload).resolve(total_steps)
    return str(info.value)


def test_invalid_configs_name_the_field() -> None:
    out_of_order = {
        "phases": [
            {"kind": "percentage", "until": 0.9, "target": 1},
            {"kind": "percentage", "until": 0.5, "target": 0},
        ]
    }
    assert "phases[1].until=0.5 must be greater than phases[0].until=0.9" in _error(out_of_order)

    rest_not_last = {"phases": [{"kind": "rest", "target": 1}, {"kind": "steps", "steps": 3, "target": 0}]}
    assert "phases[0]: a 'rest' phase must be the last phase" in _error(rest_not_last)

    overlapping = {
        "phases": [
            {"kind": "steps", "steps": 500, "target": 1},
            {"kind": "percentage", "until": 0.1, "target": 0},
        ]
    }
    message = _error(overlapping, 1000)
    assert "phases[1].until=0.1 ends at step 100" in message
    assert "overlap" in message

    too_long = {
        "phases": [{"kind": "steps", "steps": 500, "target": 1}, {"kind": "steps", "steps": 600, "target": 0}]
    }
    assert "phases[1] ends at step 1100, beyond total_steps=1000" in _error(too_long, 1000)

    assert "total_steps is required: phases[1]" in _error(WARMUP_COSINE, None)

    exponential_to_zero = {
        "phases": [{"kind": "steps", "steps": 5, "target": 0.0, "curve": {"type": "exponential"}}]
    }
    assert "phases[0].curve: exponential needs positive endpoints" in _error(exponential_to_zero)

    assert "phases.0.steps" in _error({"phases": [{"kind": "steps", "steps": 0, "target": 1}]}).replace(
        "\n", " "
    )
    assert "phases.0.percentage.until" in _error(
        {"phases": [{"kind": "percentage", "until": 1.5, "target": 1}]}
    )
    assert "extra" in _error({"phases": [{"kind": "steps", "steps": 1, "target": 1, "typo": 1}]}).lower()
    assert "phases" in _error({"phases": []})
    with pytest.raises(ValueError, match="curve='sine'"):
        piecewise_schedule().for_steps(3, 1.0, curve="sine")  # type: ignore[arg-type]


def test_scheduler_sets_each_group_lr_from_its_base() -> None:
    optimizer = _optimizer(0.1, 0.02)
    config = PiecewiseScheduleConfig.model_validate(WARMUP_COSINE)
    scheduler = build_piecewise_lr(config, optimizer, total_steps=1000)
    schedule = config.resolve(1000)
    for step in range(1001):
        expected = [0.1 * schedule.multiplier(step), 0.02 * schedule.multiplier(step)]
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(expected, rel=1e-12, abs=1e-18)
        assert scheduler.get_last_lr() == pytest.approx(expected, rel=1e-12, abs=1e-18)
        optimizer.step()
        scheduler.step()


def test_resume_reproduces_the_uninterrupted_lrs() -> None:
    schedule = PiecewiseScheduleConfig.model_validate(WARMUP_COSINE).resolve(300)
    straight_opt = _optimizer(0.5)
    straight = PiecewiseLR(straight_opt, schedule)
    lrs = []
    for _ in range(300):
        straight_opt.step()
        straight.step()
        lrs.append(straight_opt.param_groups[0]["lr"])

    first_opt = _optimizer(0.5)
    first = PiecewiseLR(first_opt, schedule)
    for _ in range(137):
        first_opt.step()
        first.step()
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    resumed_opt = _optimizer(0.5)  # fresh optimizer: its LR must come from the scheduler state
    resumed = PiecewiseLR(resumed_opt, schedule)
    resumed.load_state_dict(state)
    assert resumed_opt.param_groups[0]["lr"] == lrs[136]
    resumed_lrs = lrs[:137]
    for _ in range(300 - 137):
        resumed_opt.step()
        resumed.step()
        resumed_lrs.append(resumed_opt.param_groups[0]["lr"])
    assert resumed_lrs == lrs
    with pytest.raises(KeyError, match="last_epoch"):
        resumed.load_state_dict({"base_lrs": [0.5]})


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR"
    assert length == 13
    ihdr = data[16 : 16 + 13]
    (crc,) = struct.unpack(">I", data[29:33])
    assert crc == zlib.crc32(kind + ihdr)
    assert data.endswith(b"IEND\xaeB`\x82")
    width, height = struct.unpack(">II", ihdr[:8])
    return width, height


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_lr_plot_cli_writes_a_png(tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    if fmt == "json":
        source = tmp_path / "sched.json"
        source.write_text(json.dumps({"train": {"lr_scheduler": WARMUP_COSINE}}))
        extra = ["--key", "train.lr_scheduler"]
    else:
        source = tmp_path / "sched.yaml"
        source.write_text(
            "initial_multiplier: 0.0\nphases:\n"
            "  - {kind: steps, steps: 100, target: 1.0}\n"
            "  - {kind: percentage, until: 0.9, target: 0.1, curve: {type: cosine}}\n"
            "  - {kind: rest, target: 0.0, curve: {type: polynomial, power: 2}}\n"
        )
        extra = ["--base-lr", "3e-4"]
    out = tmp_path / "lr.png"
    assert cli_main(["lr-plot", str(source), "-o", str(out), "--total-steps", "1000", *extra]) == 0
    assert out.stat().st_size > 1000
    assert _png_size(out) == (640, 320)
    assert "wrote" in capsys.readouterr().out


def test_lr_plot_cli_reports_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "sched.yaml"
    source.write_text(json.dumps(WARMUP_COSINE))
    out = tmp_path / "lr.png"
    assert cli_main(["lr-plot", str(source), "-o", str(out)]) == 2
    assert "total_steps is required" in capsys.readouterr().err
    assert cli_main(["lr-plot", str(source), "-o", str(out), "--key", "train.lr", "--total-steps", "10"]) == 2
    assert "no key 'train'" in capsys.readouterr().err
    assert cli_main(["lr-plot", str(tmp_path / "missing.yaml"), "-o", str(out)]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert not out.exists()
