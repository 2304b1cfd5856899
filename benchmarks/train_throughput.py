"""Training throughput of the d9d engine against its peers, one GPU, same shapes, one invocation.

    python benchmarks/train_throughput.py [--model dense|moe|llama3|both] [--steps 10] [--warmup 3]
        [--peers d9d,transformers,torchtitan] [--d9d-variants compiled,compiled-autotune,eager]
        [--d9d-batches ...]
        [--d9d-ac none,full,selective,selective-op,selective-mix]
        [--titan-ac none,full,selective,selective-op]
        [--batch 8] [--seq 2048] [--row-timeout 600] [--budget-s S] [--profile] [--out FILE]
    python benchmarks/train_throughput.py --merge dense.json moe.json [--out FILE]

Every row trains a randomly initialized model with bf16 parameters and fused AdamW on batch 8 x 2048
(no downloads) and runs in its own subprocess, one after another, each under a timeout; a failing row
records its error and the table goes on. Rows:

- d9d through the real engine (`d9d.engine.Trainer`), `compiled` (`compile: {enabled: true}`) and `eager`
  (`compile: {enabled: false}`); `compiled-kernels` and `compiled-autotune` (`mode:
  max-autotune-no-cudagraphs`) vary the compiled row, `compiled-a2a` puts the MoE layers behind the
  expert-parallel exchange on one rank, `compiled-a2a-static` behind that exchange with a static
  capacity, which reads no split sizes, and `compiled-breaks` runs the local dispatch and combine eagerly
  between the same compiled pieces (`throughput/d9d_peer.py`); `eager-legacy` omits the
  section, for an engine without it. Each on the
  batch kinds of `throughput/d9d_peer.py`: bare random tokens, the built-in text provider's collated
  batches (full and right-padded) and packed documents of mean 512 tokens.
- transformers (plain, + Liger kernels: rope, rms_norm, swiglu, fused linear cross-entropy, +
  `torch.compile`); torchtitan 0.2.2 (eager, and with its per-block compile of model and loss). Both are
  optional extras, never dependencies of d9d.

Activation checkpointing (`--d9d-ac`, `--titan-ac`, default `none`): each d9d row and each torchtitan row once
per mode, the label naming it; `full` recomputes every layer, `selective` every second one (torchtitan's
`selective_ac_option: "2"`, d9d's `every: 2`), `selective-op` keeps the matmul and attention outputs of every
layer (torchtitan's `"op"`, d9d's `ops: [matmul, attention]`), `selective-mix` (d9d only: `--titan-ac`
refuses it) recomputes every second layer whole and the others op-level (`every: 2` with `ops: [matmul,
attention]`); a d9d row whose mode torchtitan has no row for shows `-` against it. The `vs no AC` column
gives tok/s and peak memory against the same row without checkpointing. For the longest sequence a mode
trains, rerun with `--batch 1 --seq 65536` (a row that runs out of memory records the error).

Shapes: Qwen3-0.6B (28 layers, hidden 1024, 16/8 heads, head_dim 128, ffn 3072, vocab 151936, untied) and a
small Qwen3-MoE (16 layers, 16/4 heads, 64 experts top-8, moe ffn 512); `--model llama3`: Llama-3.2-1B's shape
(16 layers, hidden 2048, 32/8 heads of 64, ffn 8192, vocab 128256, Llama 3.1 RoPE scaling; untied), against
torchtitan's own `llama3` (not yet measured on a GPU). MFU = 6 × active parameters (incl.
the LM head) + causal attention, against 989 TFLOP/s. `--profile` adds a per-category GPU-time breakdown of
the d9d and torchtitan steps (torch.profiler, GPU activity only) and the idle gaps by what ended them (with
`--profile-ops`, the host op and d9d frame that launched the next kernel). Needs CUDA.

`--model deepseek_v3`: a small DeepSeek-V3 of the MoE row's size (`common.DEEPSEEK_V3`: 16 layers, the first
dense, hidden 1024, MLA with 16 heads, 64 experts top-8 + 1 shared, sigmoid, 4 of 8 groups; about 2.0B
parameters, 0.51B active), against torchtitan's own `deepseek_v3` (no transformers row: pass `--peers
d9d,torchtitan`); no expert-bias update on either side. Its MFU counts MLA's widths
(`common.deepseek_v3_flops_per_token`).

Time on one H100: the dense rows take about 7 minutes, the MoE rows longer (Liger's fused MoE kernels
autotune for minutes on their first step, the compiled rows compile for one to two minutes). Where one
command is capped below that, run `--model dense` and `--model moe` back to back on the same machine and
print one table with `--merge`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast, get_args

from throughput.common import AC_MODES, MODEL_NAMES, PROFILE_STEPS, TITAN_AC_MODES, AcMode, one_rank_env
from throughput.d9d_peer import D9dBatch, D9dVariant

D9D_VARIANTS: tuple[str, ...] = get_args(D9dVariant)
D9D_BATCHES: tuple[str, ...] = get_args(D9dBatch)
HF_VARIANTS = ("plain", "liger", "compile")
TITAN_VARIANTS = ("eager", "compile")
LABELS = {
    ("transformers", "plain"): "transformers",
    ("transformers", "liger"): "transformers + Liger",
    ("transformers", "compile"): "transformers + torch.compile",
    ("torchtitan", "eager"): "torchtitan 0.2.2, eager",
    ("torchtitan", "compile"): "torchtitan 0.2.2 + per-block compile",
}


@dataclass(frozen=True)
class Row:
    model: str
    peer: str  # d9d | transformers | torchtitan
    variant: str
    batch: str = "random"
    ac: str = "none"  # activation checkpointing, `common.AC_MODES`

    @property
    def label(self) -> str:
        base = (
            f"d9d {self.variant}, {self.batch}" if self.peer == "d9d" else LABELS[(self.peer, self.variant)]
        )
        return base if self.ac == "none" else f"{base}, AC {self.ac}"

    def spec(self) -> str:
        return f"{self.model}:{self.peer}:{self.variant}:{self.batch}:{self.ac}"

    @staticmethod
    def parse(spec: str) -> Row:
        model, peer, variant, batch, ac = spec.split(":")
        return Row(model, peer, variant, batch, ac)


def _csv(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> list[str]:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(allowed)}")
        return items

    return parse


def plan(args: argparse.Namespace) -> list[Row]:
    """d9d rows first (the subject, and the rows a short budget must not lose), then the peers."""
    models = {
        "dense": ["dense"],
        "moe": ["moe"],
        "llama3": ["llama3"],
        "deepseek_v3": ["deepseek_v3"],
        "both": ["dense", "moe"],
    }[args.model]
    rows: list[Row] = []
    for model in models:
        if "d9d" in args.peers:
            rows += [
                Row(model, "d9d", v, b, ac)
                for v in args.d9d_variants
                for b in args.d9d_batches
                for ac in args.d9d_ac
            ]
        if "torchtitan" in args.peers:
            rows += [Row(model, "torchtitan", v, ac=ac) for v in args.titan_variants for ac in args.titan_ac]
        if "transformers" in args.peers:
            rows += [Row(model, "transformers", v) for v in args.hf_variants]
    return rows


# ---- one row, in the child process ----


def run_row(row: Row, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("this benchmark needs CUDA")
    match row.peer:
        case "d9d":
            from throughput import d9d_peer

            one_rank_env()
            variant = cast(d9d_peer.D9dVariant, row.variant)
            batch = cast(d9d_peer.D9dBatch, row.batch)
            return d9d_peer.run(
                row.model,
                variant,
                batch,
                args.steps,
                args.warmup,
                args.profile,
                args.profile_ops,
                json.loads(args.d9d_arch),
                cast(AcMode, row.ac),
            )
        case "transformers":
            from throughput import hf_peer

            return hf_peer.run(row.model, cast(hf_peer.HfVariant, row.variant), args.steps, args.warmup)
        case "torchtitan":
            from throughput import titan_peer

            profiled = PROFILE_STEPS if args.profile else 0
            return titan_peer.run(
                row.model, row.variant == "compile", args.steps, args.warmup, cast(AcMode, row.ac), profiled
            )
    raise ValueError(f"unknown peer {row.peer!r}")


def child_main(args: argparse.Namespace) -> None:
    row = Row.parse(args.one_row)
    try:
        result = run_row(row, args)
    except Exception as e:  # the parent's table shows the error; the traceback goes to stderr
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"[:600]}
    Path(args.row_out).write_text(json.dumps(result))


# ---- the parent: one subprocess per row ----


def spawn(row: Row, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--one-row", row.spec(), "--row-out", str(out)]
        cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--profile"] * args.profile)
        cmd += ["--profile-ops"] * args.profile_ops + ["--d9d-arch", args.d9d_arch]
        start = time.perf_counter()
        # The shape reaches the row through the environment (`throughput.common` reads it on import).
        env = {**os.environ, "D9D_BENCH_BATCH": str(args.batch), "D9D_BENCH_SEQ": str(args.seq)}
        # Own session, so a timeout also ends the row's compile workers.
        proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - start}
        wall = time.perf_counter() - start
        if not out.exists():
            return {"error": f"exited with code {rc} before writing a result", "wall_s": wall}
        result: dict[str, Any] = json.loads(out.read_text())
        result["wall_s"] = wall
        return result


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Ratios of tok/s against the peers' rows with the same activation checkpointing, and tok/s and peak
    memory against the same row without it (`x_no_ac`, `mem_x_no_ac`)."""

    def find(model: str, peer: str, variant: str, batch: str = "random", ac: str = "none") -> dict[str, Any]:
        for r in results:
            if (r["model"], r["peer"], r["variant"], r["batch"], r.get("ac", "none")) == (
                model,
                peer,
                variant,
                batch,
                ac,
            ):
                return r
        return {}

    for r in results:
        if "tokens_per_s" not in r:
            continue
        ac = r.get("ac", "none")
        d9d = r["peer"] == "d9d"
        for key, ref in (
            ("x_titan_compile", find(r["model"], "torchtitan", "compile", ac=ac)),
            ("x_transformers", find(r["model"], "transformers", "plain")),
            ("x_own_random", find(r["model"], r["peer"], r["variant"], ac=ac) if d9d else {}),
            ("x_no_ac", find(r["model"], r["peer"], r["variant"], r["batch"]) if ac != "none" else {}),
        ):
            if ref.get("tokens_per_s"):
                r[key] = r["tokens_per_s"] / ref["tokens_per_s"]
            if key == "x_no_ac" and ref.get("peak_gib"):
                r["mem_x_no_ac"] = r["peak_gib"] / ref["peak_gib"]


def table(results: list[dict[str, Any]]) -> str:
    def ratio(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.2f}x" if key in r else "-"

    def no_ac(r: dict[str, Any]) -> str:
        if "x_no_ac" not in r:
            return "-"
        return f"{r['x_no_ac']:.2f}x / {r['mem_x_no_ac']:.2f}x" if "mem_x_no_ac" in r else ratio(r, "x_no_ac")

    lines = [
        "| model | row | tok/s | MFU | peak GiB | 1st step s | vs titan+compile | vs transformers "
        "| vs own random | vs no AC (tok/s / memory) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        head = f"| {MODEL_NAMES[r['model']]} | {r['label']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:160].replace('|', '/')} | | | | | | | |")
            continue
        lines.append(
            f"{head} {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | "
            f"{r.get('first_step_s') or float('nan'):.1f} | {ratio(r, 'x_titan_compile')} | "
            f"{ratio(r, 'x_transformers')} | {ratio(r, 'x_own_random')} | {no_ac(r)} |"
        )
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    for package in ("transformers", "liger_kernel", "torchtitan", "triton"):
        try:
            from importlib.metadata import version

            info[package] = version(package.replace("_", "-"))
        except Exception:  # an optional peer that is not installed
            info[package] = None
    return info


def parent_main(args: argparse.Namespace) -> None:
    from d9d.core.files import atomic_write_text

    rows = plan(args)
    env = environment()
    print(f"{len(rows)} rows; {json.dumps(env)}", flush=True)
    deadline = time.perf_counter() + args.budget_s if args.budget_s else None
    results: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        timeout = args.row_timeout
        if deadline is not None:
            timeout = min(timeout, deadline - time.perf_counter())
        if timeout < 30:
            result: dict[str, Any] = {"error": "skipped: out of the --budget-s time"}
        else:
            print(f"[{i + 1}/{len(rows)}] {row.model}: {row.label}", flush=True)
            result = spawn(row, args, timeout)
        results.append({**asdict(row), "label": row.label, **result})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "profile"}), flush=True)
        add_ratios(results)
        if args.out:
            atomic_write_text(
                Path(args.out), json.dumps({**env, "args": vars(args), "results": results}, indent=1)
            )
    report([env], results)


def report(envs: list[dict[str, Any]], results: list[dict[str, Any]]) -> None:
    from throughput.profile import render

    print("\n" + "\n".join(json.dumps(env) for env in envs) + f"\n{table(results)}", flush=True)
    for r in results:
        if "profile" in r:
            print(f"\n{MODEL_NAMES[r['model']]}, {r['label']}:\n{render(r['profile'])}", flush=True)


def merge_main(args: argparse.Namespace) -> None:
    """One table from several runs' `--out` files (e.g. the dense and the MoE half on the same machine)."""
    runs = [json.loads(Path(f).read_text()) for f in args.merge]
    results = [
        {k: v for k, v in r.items() if not k.startswith(("x_", "mem_x_"))}
        for run in runs
        for r in run["results"]
    ]
    add_ratios(results)
    envs = [{k: v for k, v in run.items() if k != "results"} for run in runs]
    if args.out:
        from d9d.core.files import atomic_write_text

        merged = {"runs": envs, "merged_from": args.merge, "results": results}
        atomic_write_text(Path(args.out), json.dumps(merged, indent=1))
    report(envs, results)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["dense", "moe", "llama3", "deepseek_v3", "both"], default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--peers", type=_csv(("d9d", "transformers", "torchtitan")), default="d9d,transformers,torchtitan"
    )
    parser.add_argument("--d9d-variants", type=_csv(D9D_VARIANTS), default="compiled,eager")
    parser.add_argument("--d9d-batches", type=_csv(D9D_BATCHES), default="random,collate,padded,packed")
    parser.add_argument("--hf-variants", type=_csv(HF_VARIANTS), default=",".join(HF_VARIANTS))
    parser.add_argument("--titan-variants", type=_csv(TITAN_VARIANTS), default=",".join(TITAN_VARIANTS))
    parser.add_argument(
        "--d9d-ac", type=_csv(AC_MODES), default="none", help="activation checkpointing modes of the d9d rows"
    )
    parser.add_argument(
        "--titan-ac",
        type=_csv(TITAN_AC_MODES),
        default="none",
        help="activation checkpointing modes of torchtitan (it has no selective-mix)",
    )
    parser.add_argument("--batch", type=int, default=8, help="samples per step (every row)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sample (every row)")
    parser.add_argument("--row-timeout", type=float, default=600.0)
    parser.add_argument("--budget-s", type=float, default=None, help="skip the rows that would start past it")
    parser.add_argument(
        "--profile", action="store_true", help="GPU-time breakdown of the d9d and torchtitan steps"
    )
    parser.add_argument(
        "--profile-ops",
        action="store_true",
        help="with --profile: also record host ops and print the ATen ops by GPU time with input shapes "
        "(diagnosis only: host recording inflates the idle gaps)",
    )
    parser.add_argument(
        "--d9d-arch",
        default="{}",
        help="JSON merged into the d9d rows' model architecture, e.g. '{\"loss_chunk_size\": 4096}'",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--merge", nargs="+", default=None, help="--out files to print as one table")
    parser.add_argument("--one-row", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--row-out", default=None, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.one_row:
        child_main(args)
    elif args.merge:
        merge_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()
