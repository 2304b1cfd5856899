"""The engine on CUDA/NCCL under torchrun, against one process on the same global batch.

Every layout is compared with two references: one GPU (the same kernels, so any difference is the layout's:
reduction order, stage boundaries, expert all-to-all) and, for the 2-GPU layouts, gloo on CPU. GPU and CPU
kernels differ (compiled Triton kernels on CUDA, eager on CPU; MoE routing then flips on near-ties), so the
NCCL-vs-gloo bound is not a fixed number: it is what one GPU and one CPU process differ by on the same
batches, plus the layout tolerance. A layout that trained wrong (the zero-bubble × FSDP run whose loss
did not move) misses both by orders of magnitude.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.engine_fixtures import jsonl_losses, subprocess_env, torchrun_command

STEPS = 8
LAYOUT_RTOL = 1e-5
"""Relative loss difference a correct 2-GPU layout keeps from one process on the same device over 8 steps,
float32. Measured on 4 × H200, 2026-11-26: ≤ 9e-8 for every layout; one GPU against one CPU process 1.6e-7;
the expert-parallel defect fixed that day showed as 1.6e-2."""
EXAMPLE_RTOL = 3e-4
"""The same over the 4-GPU example's 20 steps at a wider shape with expert bias (measured: 3.1e-5)."""


def _hf_moe(path: Path) -> None:
    """GPU and CPU random init draw different streams, so every run starts from one checkpoint."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,  # ZBV at pp 2: four stages of at least one layer
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)


def _job(
    run_dir: Path,
    mesh: dict[str, int],
    schedule: str | None,
    backend: dict[str, Any] | None = None,
    compile_section: dict[str, Any] | None = None,
) -> dict[str, Any]:
    options: dict[str, Any] = {"source_checkpoint": str(run_dir.parent / "hf")}
    if backend is not None:
        options["parallel"] = {"expert_backend": backend}
    extra = {} if compile_section is None else {"compile": compile_section}
    return {
        **extra,
        "run": {"name": run_dir.name, "dir": str(run_dir)},
        "mesh": mesh,
        "pipelining": None if schedule is None else {"kind": schedule},
        "batching": {"global_batch_size": 8, "microbatch_size": 2},
        "trainer": {"total_steps": STEPS},
        "logging": {"progress_bar": "off"},
        "checkpointing": {"period": 4},
        "model": {"provider": "qwen3_moe", "options": options},
        "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
        "optimizer": {"provider": "adamw", "options": {"lr": 3e-3}},
    }


class _Run:
    """A torchrun launch of `job` in the background; `losses()` waits for it."""

    def __init__(self, job: dict[str, Any], nproc: int, cuda: bool) -> None:
        self.run_dir = Path(job["run"]["dir"])
        path = self.run_dir.parent / f"{self.run_dir.name}.yaml"
        path.write_text(yaml.safe_dump(job))
        env = subprocess_env() if cuda else subprocess_env(CUDA_VISIBLE_DEVICES="")  # gloo/CPU reference
        self.log = self.run_dir.parent / f"{self.run_dir.name}.log"
        with self.log.open("w") as sink:
            self.proc = subprocess.Popen(
                torchrun_command(path, nproc=nproc), env=env, stdout=sink, stderr=subprocess.STDOUT
            )

    def losses(self) -> list[float]:
        code = self.proc.wait(timeout=600)
        if code != 0:
            lines = self.log.read_text(errors="replace").splitlines()
            errors = [ln for ln in lines if "Error" in ln or "error:" in ln][:10]
            raise AssertionError(f"{self.run_dir.name} exited {code}:\n" + "\n".join(errors + lines[-30:]))
        return jsonl_losses(self.run_dir)


def _torchrun(job: dict[str, Any], nproc: int, cuda: bool) -> list[float]:
    return _Run(job, nproc, cuda).losses()


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


LAYOUTS = {
    "dp2": ({"data_parallel_replicate": 2}, None),  # replicas of plain parameters, experts included
    "dp2xep2": ({"data_parallel_replicate": 2, "expert_parallel": 2}, None),
    "fsdp2xep2": ({"data_parallel_shard": 2, "expert_parallel": 2}, None),
    "fsdp2": ({"data_parallel_shard": 2}, None),  # no expert parallelism: the experts sharded by FSDP
    "pp2-1f1b": ({"pipeline_parallel": 2}, "1f1b"),
    "pp2-zbv": ({"pipeline_parallel": 2}, "zbv"),  # split backward through compiled blocks
    "pp2-dualpipev": ({"pipeline_parallel": 2}, "dualpipev"),
    # the exchange with a static capacity, sized exactly to the first step's largest load: later steps
    # overflow and rerun (d9d.engine.exchange)
    "dp2xep2-capacity": ({"data_parallel_replicate": 2, "expert_parallel": 2}, None),
    # the exchange in 2 chunks whose NCCL transfers overlap the other chunk's experts (async all-to-alls)
    "fsdp2xep2-overlap": ({"data_parallel_shard": 2, "expert_parallel": 2}, None),
    # token-split MoE layers and sequence shards: compiled blocks with their collectives traced by inductor,
    # the balancing loss (the checkpoint's router_aux_loss_coef) summed over the ranks that split a sequence
    "tp2": ({"tensor_parallel": 2}, None),
    "cp2": ({"context_parallel_shard": 2}, None),
    # the compiled blocks replayed as CUDA graphs (compile.mode: reduce-overhead) where the config allows it
    "pp2-1f1b-cudagraphs": ({"pipeline_parallel": 2}, "1f1b"),
    "pp2-interleaved-cudagraphs": ({"pipeline_parallel": 2}, "interleaved_1f1b"),
    # replicas: the gradient synchronizer's hooks take each graphed backward's gradients into its buckets
    "dp2-cudagraphs": ({"data_parallel_replicate": 2}, None),
    # the capacity exchange's all-to-alls inside the graphed blocks; sized to the first step's loads, so
    # later steps overflow, grow the capacity (new shapes: new recordings) and rerun
    "dp2xep2-capacity-cudagraphs": ({"data_parallel_replicate": 2, "expert_parallel": 2}, None),
}
COMPILE = {
    "dp2-cudagraphs": {"mode": "reduce-overhead"},
    "dp2xep2-capacity-cudagraphs": {"mode": "reduce-overhead"},
    "pp2-1f1b-cudagraphs": {"mode": "reduce-overhead"},
    "pp2-interleaved-cudagraphs": {"mode": "reduce-overhead"},
}
BACKENDS = {
    "dp2xep2-capacity": {"kind": "all_to_all", "capacity_factor": 1.0, "capacity_align": 1},
    "dp2xep2-capacity-cudagraphs": {"kind": "all_to_all", "capacity_factor": 1.0, "capacity_align": 1},
    "fsdp2xep2-overlap": {"kind": "all_to_all", "overlap_chunks": 2},
}


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[float], list[float], dict[str, _Run]]:
    """The references — one GPU and one CPU process on the same global batches, from the same checkpoint —
    and the gloo run of every layout this session tests, all at once (the CPU runs overlap the GPU ones).
    Only the selected layouts' (`-k`, or `tests.gpu_suite` dealing the layouts to several processes): 15
    gloo runs of two ranks each, started by every one of several processes, held the host's cores."""
    tmp = tmp_path_factory.mktemp("engine-gpu")
    _hf_moe(tmp / "hf")
    selected = {
        item.callspec.params["layout"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_engine_on_two_gpus_matches_one_gpu_and_gloo"
    }
    gloo = {
        name: _Run(
            _job(tmp / f"gloo-{name}", mesh, sched, BACKENDS.get(name), COMPILE.get(name)), 2, cuda=False
        )
        for name, (mesh, sched) in LAYOUTS.items()
        if name in selected
    }
    one_cpu = _Run(_job(tmp / "one-cpu", {}, None), 1, cuda=False)
    one_gpu = _torchrun(_job(tmp / "one-gpu", {}, None), 1, cuda=True)
    cpu = one_cpu.losses()
    assert one_gpu[-1] < one_gpu[0]
    print(f"one GPU {one_gpu}\none CPU {cpu}\ndevice difference {_max_rel(one_gpu, cpu):.2e}")
    return tmp, one_gpu, cpu, gloo


@pytest.mark.gpu
@pytest.mark.gpus(2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engine_on_two_gpus_matches_one_gpu_and_gloo(
    runs: tuple[Path, list[float], list[float], dict[str, _Run]], layout: str
) -> None:
    tmp, one_gpu, one_cpu, gloo_runs = runs
    mesh, schedule = LAYOUTS[layout]
    job = _job(tmp / f"nccl-{layout}", mesh, schedule, BACKENDS.get(layout), COMPILE.get(layout))
    nccl = _torchrun(job, 2, cuda=True)
    gloo = gloo_runs[layout].losses()
    layout_gpu, layout_cpu = _max_rel(nccl, one_gpu), _max_rel(gloo, one_cpu)
    device = _max_rel(one_gpu, one_cpu)
    print(f"{layout}: nccl {nccl}\n  vs one GPU {layout_gpu:.2e}, gloo vs one CPU {layout_cpu:.2e}")
    assert nccl[-1] < nccl[0]
    assert layout_gpu <= LAYOUT_RTOL, (layout, nccl, one_gpu)
    assert layout_cpu <= 1e-5, (layout, gloo, one_cpu)  # float32 CPU kernels: exact up to reduction order
    assert _max_rel(nccl, gloo) <= device + LAYOUT_RTOL, (layout, nccl, gloo, device)
    if layout in COMPILE:  # graphs asked for: none of the compiled graphs may have run without them
        log = (tmp / f"nccl-{layout}.log").read_text(errors="replace")
        assert "without CUDA graphs" not in log, log[-4000:]


def _eval_losses(run_dir: Path) -> dict[int, float]:
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["values"]["eval/loss"] for r in records if "eval/loss" in r.get("values", {})}


EVAL_SECTION = {
    "data": {"provider": "tests.engine_fixtures:GlobalIndexData"},
    "batch_size": 4,
    "batches": 3,
    "period": 2,
}


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mesh", "schedule"),
    [
        pytest.param({}, None, id="1gpu"),
        pytest.param({"data_parallel_replicate": 2}, None, id="dp2", marks=pytest.mark.gpus(2)),
        pytest.param({"pipeline_parallel": 2}, "1f1b", id="pp2-1f1b", marks=pytest.mark.gpus(2)),
    ],
)
def test_eval_under_cuda_graphs_matches_the_default_mode(
    tmp_path: Path, mesh: dict[str, int], schedule: str | None
) -> None:
    """An eval section under `compile.mode: reduce-overhead`: the eval forwards (no gradients: inference
    graphs of their own, one graph step per microbatch, or per forward-only schedule under pipelining) give
    the default mode's eval losses at steps 2, 4 and 6 (three microbatches each: the trees warm a graph up
    at its first call and record it at its second, so the later evaluations run recorded graphs), the
    training steps around them the default mode's losses, and no graph runs without CUDA graphs."""
    _hf_moe(tmp_path / "hf")
    nproc = mesh.get("data_parallel_replicate", 1) * mesh.get("pipeline_parallel", 1)
    started = {}
    for mode in ("default", "reduce-overhead"):
        job = _job(tmp_path / mode, mesh, schedule, compile_section={"mode": mode})
        job["trainer"]["total_steps"] = 6
        job["eval"] = EVAL_SECTION
        started[mode] = _Run(job, nproc, cuda=True)
    losses = {mode: run.losses() for mode, run in started.items()}
    evals = {mode: _eval_losses(run.run_dir) for mode, run in started.items()}
    print(f"train {losses}\neval {evals}")
    assert sorted(evals["default"]) == sorted(evals["reduce-overhead"]) == [2, 4, 6]
    assert _max_rel(losses["reduce-overhead"], losses["default"]) <= LAYOUT_RTOL, losses
    graphed, plain = evals["reduce-overhead"], evals["default"]
    assert _max_rel([graphed[k] for k in sorted(plain)], [plain[k] for k in sorted(plain)]) <= LAYOUT_RTOL
    assert plain[6] < plain[2]  # the eval set sees the training, so a stale graph output would show
    log = started["reduce-overhead"].log.read_text(errors="replace")
    assert "without CUDA graphs" not in log, log[-4000:]


@pytest.mark.gpu
@pytest.mark.gpus(4)
def test_gpu_example_layout_on_four_gpus(tmp_path: Path) -> None:
    """examples/qwen3_moe_pretrain/gpu.yaml's layout — pp 2 × dp_shard 2 × ep 2, ZBV, compiled, expert bias,
    the text provider — at a small width, 20 steps, against one GPU on the same global batch (float32, so
    the bound says something about the layout rather than bf16 rounding)."""
    example = yaml.safe_load(Path("examples/qwen3_moe_pretrain/gpu.yaml").read_text())
    assert example["mesh"]["pipeline_parallel"] == 2 and example["pipelining"] == {"kind": "zbv"}
    assert example["model"]["options"]["architecture"]["expert_bias"] is True
    import transformers

    # Random init is drawn per pipeline stage, so both runs start from one checkpoint.
    config = transformers.Qwen3MoeConfig(
        vocab_size=259,  # the byte tokenizer
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / "hf")
    model_options = {
        "dtype": "float32",
        "source_checkpoint": str(tmp_path / "hf"),
        "architecture": {"expert_bias": True},
    }

    def job(name: str, mesh: dict[str, int], pipelining: dict[str, str] | None) -> dict[str, Any]:
        return {
            **{k: v for k, v in example.items() if k not in ("cluster", "checkpointing", "logging")},
            "run": {"name": name, "dir": str(tmp_path / name)},
            "mesh": mesh,
            "pipelining": pipelining,
            "batching": {"global_batch_size": 16, "microbatch_size": 2},
            "trainer": {"total_steps": 20},
            "logging": {"progress_bar": "off", "period": 1},
            "checkpointing": {"save_at_end": False},
            "model": {"provider": "qwen3_moe", "options": model_options},
            "data": {
                "provider": "text",
                "options": {
                    "dataset": {"paths": ["examples/qwen3_moe_pretrain/corpus.txt"], "max_length": 256}
                },
            },
            "lr_scheduler": None,
        }

    mesh = {"pipeline_parallel": 2, "data_parallel_shard": 2, "expert_parallel": 2}
    layout = _torchrun(job("four", mesh, example["pipelining"]), 4, cuda=True)
    one = _torchrun(job("one", {}, None), 1, cuda=True)  # after: the layout holds every GPU
    print(f"gpu.yaml layout {layout}\none GPU {one}\nmax relative difference {_max_rel(layout, one):.2e}")
    assert len(layout) == 20 and layout[-1] < layout[0]
    assert _max_rel(layout, one) <= EXAMPLE_RTOL, (layout, one)
