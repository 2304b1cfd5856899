r"""Training throughput on the GPUs of one host: d9d's parallel layouts against its own 1-GPU row and against
torchtitan 0.2.2, one row per process, in one command.

    python benchmarks/multi_gpu.py [--gpus N] [--rows GLOB,...] [--launchers torchrun,ray]
        [--ray-rows GLOB,...] [--steps 10] [--warmup 3] [--timeout-per-row 420] [--budget-s S]
        [--pp-microbatch 2] [--microbatch 8] [--cp-seq 8192] [--set KEY=VALUE ...]
        [--variant NAME:KEY=VALUE[;KEY=VALUE] ...]
        [--variants-on-1gpu]
        [--profile GLOB,... [--profile-steps 3] [--profile-trace]] [--concurrent-1gpu] [--numa-binding MODE]
        [--repeat N] [--out FILE] [--list]
    python benchmarks/multi_gpu.py --merge a.json b.json [--out FILE]     # one table from several runs
    python benchmarks/multi_gpu.py --smoke                                # CPU, gloo, 2 ranks, tiny shapes

Rows (N = `--gpus`, default every visible GPU; h = N/2). Every d9d row runs under torchrun
(`torchrun --standalone -m d9d.engine.launch JOB`); the rows named by `--ray-rows` (default the two FSDP
rows) run a second time through `d9d train JOB` on a local Ray instance (rank actors + coordinator), id
suffix `@ray`. `--launchers` keeps one launcher only.

| id | model | GPUs | layout (d9d `mesh`) |
|---|---|---|---|
| dense-1gpu | Qwen3-0.6B | 1 | one rank: the scaling baseline |
| dense-fsdp | Qwen3-0.6B | N | data_parallel_shard N |
| dense-hsdp | Qwen3-0.6B | N | data_parallel_replicate 2 × data_parallel_shard h |
| dense-ddp | Qwen3-0.6B | N | data_parallel_replicate N: full weights and optimizer state on every GPU |
| dense-tp-fsdp | Qwen3-0.6B | N | tensor_parallel 2 × data_parallel_shard h |
| dense-cp-fsdp | Qwen3-0.6B | N | context_parallel_shard 2 × data_parallel_shard h, sequence `--cp-seq` |
| dense-pp-1f1b, -zbv, -dualpipev | Qwen3-0.6B | N | pipeline_parallel 2 × data_parallel_shard h |
| moe-1gpu | Qwen3-MoE | 1 | one rank: the scaling baseline |
| moe-fsdp-ep | Qwen3-MoE | N | data_parallel_shard N, expert_parallel N |
| moe-fsdp | Qwen3-MoE | N | data_parallel_shard N: the experts sharded by FSDP, no token exchange |
| moe-ddp | Qwen3-MoE | N | data_parallel_replicate N: every expert on every GPU, no token exchange |
| moe-hsdp-ep | Qwen3-MoE | N | data_parallel_replicate 2 × data_parallel_shard h, expert_parallel N |
| moe-pp-1f1b, -zbv | Qwen3-MoE | N | pipeline_parallel 2 × data_parallel_shard h, expert_parallel h |
| titan-dense-1gpu, titan-moe-1gpu | torchtitan | 1 | one rank |
| titan-dense-fsdp | torchtitan | N | `--parallelism.data_parallel_shard_degree N` |
| titan-moe-fsdp-ep | torchtitan | N | the same + `--parallelism.expert_parallel_degree N` |
| titan-moe-fsdp | torchtitan | N | `--parallelism.data_parallel_shard_degree N`, expert parallel degree 1 |
| titan-dense-tp-fsdp | torchtitan | N | `--parallelism.tensor_parallel_degree 2` (sequence parallel) |

Shapes: Qwen3-0.6B (28 layers, hidden 1024, 16/8 heads, ffn 3072, vocab 151936, untied) and the small
Qwen3-MoE (16 layers, 64 experts top-8, moe ffn 512) of `throughput/common.py`. Every row trains a randomly
initialized model on uniform random tokens, 8 × 2048 tokens per GPU (16,384; the global batch is N times
that): bf16 parameters, fused AdamW, compiled, gradient clipping off on d9d.
- d9d: the real engine through its launchers; the job is `throughput.data:RandomTokens` for data,
  `compile: {enabled: true}`, `model.options.dtype: bfloat16`. Sequences per microbatch: `--microbatch`
  (default 8: one microbatch per step on the 1-GPU, FSDP, HSDP and replica rows, two on the TP row, whose
  replica of 2 GPUs takes 16 sequences; `--microbatch 2` runs each GPU's 8 as 4 accumulated microbatches,
  torchtitan's rows as well: its `local_batch_size` is the same, its global batch unchanged); the CP row
  keeps 16,384 tokens per GPU at `--cp-seq` (4 sequences of 8192 per replica, each split over its 2 ranks);
  the pipeline rows cut each replica's 16 sequences into microbatches of `--pp-microbatch` (default 2:
  8 microbatches) with the default stage split (`model.options.parallel.stage_split`; by FLOPs:
  `--variant 'flops:model.options.parallel.stage_split={kind: flops, seq_len: 2048}'`; below the table
  each pipeline row prints its stages' measured work per microbatch, to choose `{kind: layers, layers:
  [...]}` from). `--set KEY=VALUE` is passed to every d9d row's launcher (`--set`).
- Variants (`--variant NAME:KEY=VALUE[;KEY=VALUE...]`, repeatable): every selected multi-GPU d9d row runs once
  more per variant with those overrides added to its `--set`s, as row `<id>+NAME` (`dense-fsdp+f32`,
  `dense-fsdp+f32@ray`), right after its base row in run order; `--rows` globs see the variant ids too. A
  variant row is scaled against the 1-GPU row and torchtitan like its base, and also gets `x_base`: its tok/s
  over the base row's of this run (shown beside the launcher). `--variants-on-1gpu` adds them to the 1-GPU
  d9d rows as well (`dense-1gpu+cg`), for settings that apply without sharding, such as `compile.mode`.
  One command thus sweeps settings on one warm
  machine, e.g. the FSDP settings of `model.options.parallel.fsdp` (docs/parallelism.md, "FSDP settings"):

      F=model.options.parallel.fsdp
      python benchmarks/multi_gpu.py --gpus 4 --rows 'dense-1gpu,titan-dense-*,dense-fsdp' \
          --launchers torchrun --variant "f32:$F.reduce_dtype=float32" \
          --variant "always:$F.reshard_after_forward=always" \
          --variant "never:$F.reshard_after_forward=never" \
          --variant "pf2:$F.forward_prefetch=2;$F.backward_prefetch=2"

  (`--set model.options.parallel.fsdp.reduce_dtype=float32` instead changes every d9d row of the command.)
  The pipeline rows with CUDA graphs of their compiled blocks (`compile.mode: reduce-overhead`, accepted
  for pipeline stages alone under 1F1B and for replicas alone; docs/compile.md): `--rows
  'dense-pp-1f1b*,moe-pp-1f1b*' --variant "cg:compile.mode=reduce-overhead"`; the replicas at 2-sequence
  microbatches: `--rows 'dense-ddp*,moe-ddp*' --set batching.microbatch_size=2 --variant
  "cg:compile.mode=reduce-overhead"`.
- Repeats (`--repeat N`): the selected rows run N times in one command, every second pass in reverse order
  (A B, then B A: drift over the call, e.g. a host that warms up, does not favour the row that always runs
  first), as rows `<id>#<pass>` after the first (`dense-fsdp@ray#2`); every ratio of a row is taken against
  the rows of its own pass. The key pairs (`dense-fsdp,titan-dense-fsdp`, a row and its `@ray` twin) then
  come twice from one machine.
- torchtitan: its own trainer (`torchtitan.train.Trainer` and `main`, under torchrun) through
  `throughput/titan_train.py`, which registers a train spec of torchtitan's own Qwen3 pieces with our shapes,
  a random-token loader and a metrics processor that records; configured by its own flags:
  `--training.local_batch_size 8 --training.seq_len 2048 --training.dtype bfloat16` (bf16 parameters, as
  d9d; FSDP reduces in float32, the only `mixed_precision_reduce` it accepts),
  `--compile.enable --compile.components model,loss`, `--activation_checkpoint.mode none`,
  `--optimizer.implementation fused --optimizer.lr 1e-4 --optimizer.weight_decay 0`, `--metrics.log_freq 1`.
  Its trainer clips gradients every step (`--training.max_norm 1.0`, its default; it has no off switch), which
  d9d's rows do not: a gradient norm per step, a few milliseconds. Its Qwen3 spec builds the optimizer
  without the MoE load-balancing hook (no expert-bias update), like the 1-GPU loop of `train_throughput.py`.
  It needs torchtitan 0.2.2 and the packages it imports (torchdata, tyro, docstring-parser, typeguard);
  `datasets` is stubbed, as in `throughput/titan_peer.py`.

Measured per row, from every rank (d9d: `throughput/probe.py`, installed by the data provider in each rank
process, whichever launcher; torchtitan: the recording metrics processor):
- step time: a rank's wall time from the start of one step to the start of the next (torchtitan: between
  two consecutive logs); per step the slowest rank; the median over the `--steps` steps after `--warmup`
  (the JSON also has their mean and the slowest: stalled steps show there, not in the median).
- tok/s = global tokens per step / step time; per GPU = tok/s / GPUs.
- MFU = tok/s per GPU × (6 × active parameters incl. the LM head + causal attention at the row's sequence
  length) / 989 TFLOP/s (H100/H200 dense bf16), the formula of `throughput/common.py`.
- peak GiB: the largest allocator high-water mark of any rank in any step after the first (the first holds
  compilation); `torch.cuda.max_memory_allocated`, so the caching allocator's reserve is not in it.
- scaling: tok/s per GPU over the 1-GPU row of the same model and framework (the d9d 1-GPU row runs under
  torchrun; the `@ray` rows are scaled against it too), when both ran in the run or the merged runs.
- `@ray` rows: tok/s over the same row under torchrun (`x_torchrun`, shown beside the launcher).
- vs titan: tok/s per GPU over torchtitan's row of the same model at the same GPU count: its row of the same
  layout where it has one (`moe-fsdp` against `titan-moe-fsdp`), the other N-GPU rows against titan's
  FSDP / FSDP × EP row, 1-GPU rows against titan's 1-GPU row. The CP row runs a longer sequence than
  torchtitan's rows: it gets no ratio (compare its MFU).
- Pipeline rows, the bubble. On every rank the probe times each stage pass (forward F, full backward B,
  input-gradient backward I, weight-gradient backward W; CUDA events on the compute stream, i.e. GPU time,
  taken after the pass's inputs arrived) and the span of the rank's whole pipeline program for the step
  (`PipelineExecutor.train_step`: from its first action to its last send completing).
  measured bubble = the median over timed steps of 1 − (Σ pass times of all ranks) / (ranks × the
  longest span): the share of the step's pipeline program the ranks' GPUs spend outside their passes
  (waiting for neighbours, receives, anything not inside a pass, and a rank's wait from its last pass to
  the step's end), the step's makespan taken as its longest span (`throughput/bubble.py`; before session
  33 each rank's share of its own span, averaged, which left the last stage's tail out).
  The FSDP all-gather of a stage's parameters runs inside its first
  forward (gathered once per step) and counts as pass time; the gradient reduce-scatter is issued after the
  stage's last backward, outside the passes, on its own stream.
  The prediction is `d9d pipeline-sim`'s simulator (`d9d.pipeline.simulator.simulate`) on the same program
  (schedule, pp, microbatches per step): `sim` with the measured costs (median time of each pass kind per
  stage, over ranks, timed steps and microbatches; communication latency 0), and `sim unit` with unit costs
  (F = I = W = 1), which is what `d9d pipeline-sim --schedule K --pp 2 --microbatches M` prints. The
  simulator's bubble is the same quantity: idle time of all ranks over ranks × makespan.
  The probe costs two event records per pass and a small JSON write per step, which is left out of the
  step's time (every d9d row runs with it; rows without a pipeline record only step times and peaks).

Profile (`--profile GLOB[,GLOB]`, d9d rows whose id matches, variant ids included: `moe-fsdp-ep*` takes
`moe-fsdp-ep+dedup`): where a step's time goes, on every rank. The probe of each rank (started by the data
provider, whichever launcher) runs torch.profiler (CPU activity, and CUDA on GPUs) over `--profile-steps`
steps (default 3) after the timed ones, after one more step for the profiler's own warm-up: with 3 + 10
steps, step 14 warms it up and steps 15..17 are profiled; the job runs to step 18. The profiled steps are
slower (host op recording) and are not in the timed median. The device is synchronized at the window's
edges. Each rank writes `probe/rank<r>_profile.json` (`throughput/profile.py` computes it; its docstring
has the details); the row's result gets `profile`: `ranks` (each rank's breakdown; the heaviest 15
kernels of rank 0 only), `across_ranks` (per number: mean, max and the rank with the max) and
`slowest_rank_per_step` (the rank with the longest wall time in each timed step). Numbers, in ms per step
and as a share of the profiled step's wall time:
- compute busy: time in which at least one non-communication kernel runs (the union of their intervals);
- communication busy: the same for NCCL kernels; exposed communication: communication time in which no
  compute kernel runs (what overlap would win back at most); idle: time with no kernel at all (launch gaps,
  host syncs, host work, the profiler's overhead). compute + exposed communication + idle = the step.
- by category: kernel time (a sum: overlapping kernels each count) per kind: all-to-all, send/recv (p2p or
  all-to-all: NCCL runs `all_to_all_single`, the expert exchange, as `ncclDevKernel_SendRecv`), all-gather
  and reduce-scatter (FSDP), all-reduce, broadcast, other communication; MoE token movement, optimizer,
  attention, loss, matmul, dtype copies, elementwise/reduce; `idle gaps` (= idle).
- host syncs: host time blocked on the GPU per step (`cudaStreamSynchronize` and the other blocking CUDA
  calls, a blocking device→host copy such as `.tolist()` of token counts, `.item()` of a CUDA tensor) and
  their count per step, and per rank the ops they happen in.
Load imbalance: ranks end a step together (they meet in collectives), so the slow rank shows as the one
with the most compute busy, the others as exposed all-to-all. `--profile-trace` also writes each rank's Chrome
trace (`probe/rank<r>_trace.json.gz` in the row's work dir; megabytes each). On CPU ranks (`--smoke`) the
intervals are the leaf CPU ops, a gloo collective counted whole. The table printout has a section per
profiled row below the table.

Not measured: the first step (compile), start-up time, checkpointing. Every row is a fresh process tree on
the same machine, one after another; torch.compile's on-disk cache is shared, so later rows compile faster
(this changes start-up, not the timed steps). `--concurrent-1gpu` first runs the 1-GPU torchrun rows side
by side, one per GPU (`CUDA_VISIBLE_DEVICES`; a row's entry records its `gpu`), then the others one after
another: 1-GPU rows share only the host's CPUs, so a 4-GPU call spends a quarter of the time on them.
`--numa-binding MODE` passes torchrun's own `--numa-binding` (torch.numa: `node`, `socket`, `exclusive`,
`core-complex`) to every torchrun row, d9d's and torchtitan's alike, binding each rank's threads to the
CPUs near its GPU; the Ray rows are not bound. Run a command with and one without it to compare. A
row that fails, times out or is skipped by `--budget-s` is recorded with the last lines of its output
(`error`, `log_tail`; of a timed-out row, the lines before torchrun's shutdown) and the table goes on; before
a timed-out row is stopped, each of its Python processes' stacks is taken with `py-spy dump` when `py-spy` is
on PATH (`stacks`, by pid: where it hung).

`--py-spy GLOB[,GLOB]`: those rows run under `py-spy record --gil --threads --subprocesses` (py-spy on
PATH), which samples whichever thread holds each process's GIL; the row's entry gets `host_threads` (per
rank process, each thread's samples, those under `Trainer._run_step`, its commonest frames; and
`step_frames`: the step thread's 40 commonest frames by inclusive share) and the raw file lands beside
`--out`, gzipped (`throughput/host_stacks.py` reads it as it is). For the launchers' difference: the Ray
actor runs threads torchrun's ranks do not (the reporter's courier, Ray's own), and a step that waits on the
GPU many times feels each of them.

Output: a markdown table on stdout and a JSON file (`--out`, default
`benchmarks/results/multi_gpu_<device>_<N>gpu_<date>.json`; `--smoke`: a temporary file) with the
environment (device name as the ranks saw it, GPU count, torch / torchtitan versions, date), the arguments
and every row's numbers, per-rank records summarized, the job config it ran, the engine's set-up lines
(`setup`: the CPUs each rank bound, FSDP's units and reshard policy, what was compiled), and its error if any.

`--smoke`: CPU ranks on gloo (2 by default), the 6-layer shapes of `common.SMOKE_ARCHS`, float32, no compile,
4 × 32 tokens per rank (CP at 64, one sequence per microbatch on the pipeline rows), 2 steps after 1; checks
the script end to end, numbers mean nothing. torchtitan rows need CUDA and fail there (recorded).
Without `--smoke` it needs CUDA.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import gzip
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml
from throughput.common import ARCHS, BATCH, LR, MODEL_NAMES, PEAK_TFLOPS, SEQ, SMOKE_ARCHS, flops_per_token
from throughput.host_stacks import step_samples, thread_samples
from throughput.probe import read_profiles, read_records
from throughput.profile import across_ranks, render_ranks

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SMOKE_BATCH, SMOKE_SEQ, SMOKE_CP_SEQ = 4, 32, 64
LOG_TAIL_LINES = 30
DEFAULT_RAY_ROWS = "dense-fsdp,moe-fsdp-ep"


@dataclass(frozen=True)
class Row:
    id: str  # e.g. "dense-fsdp@ray"
    model: str  # dense | moe
    framework: str  # d9d | torchtitan
    launcher: str  # torchrun | ray
    gpus: int
    layout: str  # human-readable
    mesh: dict[str, int] = field(default_factory=dict)  # d9d mesh fields (torchtitan: its degrees)
    schedule: str | None = None  # pipelining.kind
    seq: int = SEQ
    microbatch: int = BATCH  # sequences per microbatch (d9d) / local batch (torchtitan)
    variant: str | None = None  # `--variant` NAME: this row is `base_id` with `sets` added
    sets: tuple[str, ...] = ()
    repeat: int = 1  # `--repeat` pass; passes after the first add `#<pass>` to the id

    @property
    def base_id(self) -> str:
        """The id without the variant (`dense-fsdp+f32@ray` -> `dense-fsdp@ray`)."""
        return base_id(self.id)

    @property
    def pp(self) -> int:
        return self.mesh.get("pipeline_parallel", 1)

    @property
    def data_parallel(self) -> int:
        return self.mesh.get("data_parallel_replicate", 1) * self.mesh.get("data_parallel_shard", 1)


def tokens_per_gpu(smoke: bool) -> int:
    return (SMOKE_BATCH * SMOKE_SEQ) if smoke else BATCH * SEQ


def global_batch(row: Row, smoke: bool) -> int:
    """Sequences per optimizer step: the same tokens per GPU on every row."""
    return tokens_per_gpu(smoke) * row.gpus // row.seq


def all_rows(n: int, args: argparse.Namespace) -> list[Row]:
    """Every row of the table for N GPUs (layouts that N cannot hold are left out), before selection."""
    smoke = args.smoke
    seq = SMOKE_SEQ if smoke else SEQ
    cp_seq = SMOKE_CP_SEQ if smoke else args.cp_seq
    mb = SMOKE_BATCH if smoke else args.microbatch
    pp_mb = 1 if smoke else args.pp_microbatch
    h = n // 2
    even = n >= 2 and n % 2 == 0
    # (id, framework, gpus, layout, mesh, schedule, seq, sequences per microbatch), per model
    specs: dict[str, list[tuple[str, str, int, str, dict[str, int], str | None, int, int]]] = {}
    for model in ("dense", "moe"):
        ep = {"expert_parallel": n} if model == "moe" else {}
        ep_name = f" × EP {n}" if model == "moe" else ""
        fsdp_id = "fsdp-ep" if model == "moe" else "fsdp"
        rows = [
            (f"{model}-1gpu", "d9d", 1, "1 GPU", {}, None, seq, mb),
            (f"titan-{model}-1gpu", "torchtitan", 1, "1 GPU", {}, None, seq, mb),
        ]
        if n >= 2:
            fsdp = {"data_parallel_shard": n, **ep}
            rows.append((f"{model}-{fsdp_id}", "d9d", n, f"FSDP {n}{ep_name}", fsdp, None, seq, mb))
            rows.append(
                (f"titan-{model}-{fsdp_id}", "torchtitan", n, f"FSDP {n}{ep_name}", fsdp, None, seq, mb)
            )
            if model == "moe":  # the experts sharded by FSDP like every other weight, no token exchange
                plain = {"data_parallel_shard": n}
                rows.append(("moe-fsdp", "d9d", n, f"FSDP {n}, no EP", plain, None, seq, mb))
                rows.append(("titan-moe-fsdp", "torchtitan", n, f"FSDP {n}, no EP", plain, None, seq, mb))
            # replicas only: one bucketed all-reduce of the gradients, no per-unit gathers or hooks
            ddp = {"data_parallel_replicate": n}
            rows.append((f"{model}-ddp", "d9d", n, f"replicate {n}", ddp, None, seq, mb))
            if model == "moe":  # replicated dense weights, the experts split over the same ranks
                rows.append(("moe-ddp-ep", "d9d", n, f"replicate {n} × EP {n}", {**ddp, **ep}, None, seq, mb))
        if even:
            hsdp = {"data_parallel_replicate": 2, "data_parallel_shard": h, **ep}
            rows.append(
                (f"{model}-hsdp{'-ep' * bool(ep)}", "d9d", n, f"HSDP 2 × {h}{ep_name}", hsdp, None, seq, mb)
            )
        if even and model == "dense":
            tp = {"tensor_parallel": 2, "data_parallel_shard": h}
            rows.append(("dense-tp-fsdp", "d9d", n, f"TP 2 × FSDP {h}", tp, None, seq, mb))
            rows.append(("titan-dense-tp-fsdp", "torchtitan", n, f"TP 2 × FSDP {h}", tp, None, seq, mb))
            cp = {"context_parallel_shard": 2, "data_parallel_shard": h}
            cp_mb = tokens_per_gpu(smoke) * 2 // cp_seq  # a replica's sequences: 2 GPUs' tokens
            rows.append(
                ("dense-cp-fsdp", "d9d", n, f"CP 2 × FSDP {h}, seq {cp_seq}", cp, None, cp_seq, cp_mb)
            )
        if even:
            pp_ep = {"expert_parallel": h} if model == "moe" else {}
            pp = {"pipeline_parallel": 2, "data_parallel_shard": h, **pp_ep}
            kinds = ("1f1b", "zbv", "dualpipev") if model == "dense" else ("1f1b", "zbv")
            for kind in kinds:
                layout = f"PP 2 × FSDP {h}{f' × EP {h}' * bool(pp_ep)}, {kind}"
                rows.append((f"{model}-pp-{kind}", "d9d", n, layout, pp, kind, seq, pp_mb))
        specs[model] = rows
    ray_globs = _globs(args.ray_rows)
    out: list[Row] = []
    for model, rows in specs.items():
        for row_id, framework, gpus, layout, mesh, schedule, row_seq, micro in rows:
            row = Row(row_id, model, framework, "torchrun", gpus, layout, mesh, schedule, row_seq, micro)
            out.append(row)
            if framework == "d9d" and any(fnmatch.fnmatchcase(row_id, g) for g in ray_globs):
                out.append(
                    Row(
                        f"{row_id}@ray", model, framework, "ray", gpus, layout, mesh, schedule, row_seq, micro
                    )
                )
    return with_variants(out, args.variant, one_gpu=args.variants_on_1gpu)


def split_pass(row_id: str) -> tuple[str, str]:
    """`dense-fsdp@ray#2` -> (`dense-fsdp@ray`, `#2`): the row and its `--repeat` pass suffix ('' first)."""
    stem, sep, number = row_id.partition("#")
    return stem, sep + number


def base_id(row_id: str) -> str:
    """The id without the variant and the pass (`dense-fsdp+f32@ray#2` -> `dense-fsdp@ray`)."""
    name, _, launcher = split_pass(row_id)[0].partition("@")
    return name.partition("+")[0] + (f"@{launcher}" if launcher else "")


def repeated(rows: list[Row], passes: int) -> list[Row]:
    """`rows` `passes` times, every second pass in reverse order (A B, B A, A B...: a pair's rows each run
    first once, so drift over the call does not favour one of them), ids of later passes `<id>#<pass>`."""
    out = list(rows)
    for k in range(2, passes + 1):
        order = rows[::-1] if k % 2 == 0 else rows
        out += [replace(r, id=f"{r.id}#{k}", repeat=k) for r in order]
    return out


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """`NAME:KEY=VALUE[;KEY=VALUE...]` -> (NAME, overrides)."""
    name, sep, body = text.partition(":")
    sets = tuple(item.strip() for item in body.split(";") if item.strip())
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not sets:
        raise ValueError(
            f"--variant {text!r}: expected NAME:KEY=VALUE[;KEY=VALUE...] (NAME of [A-Za-z0-9_.-])"
        )
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--variant {text!r}: {item!r} is not KEY=VALUE")
    return name, sets


def with_variants(rows: list[Row], variants: list[str], *, one_gpu: bool = False) -> list[Row]:
    """Each multi-GPU d9d row followed by one row per variant; the 1-GPU d9d rows too with `one_gpu`
    (`--variants-on-1gpu`: for settings that apply without sharding, e.g. `compile.mode`)."""
    parsed = [parse_variant(v) for v in variants]
    names = [name for name, _ in parsed]
    if len(set(names)) != len(names):
        raise ValueError(f"--variant names repeat: {names}")
    out: list[Row] = []
    for row in rows:
        out.append(row)
        if row.framework != "d9d" or (row.gpus < 2 and not one_gpu):
            continue
        for name, sets in parsed:
            stem, _, launcher = row.id.partition("@")
            variant_id = f"{stem}+{name}" + (f"@{launcher}" if launcher else "")
            out.append(
                replace(
                    row,
                    id=variant_id,
                    layout=f"{row.layout} [{name}]",
                    variant=name,
                    sets=sets,
                    microbatch=_microbatch_set(sets, row.microbatch),
                )
            )
    return out


def _microbatch_set(sets: tuple[str, ...], default: int) -> int:
    """The microbatch a variant's `batching.microbatch_size=K` gives its row: the pipeline rows' simulated
    bubble counts microbatches from it (a variant row kept the base row's count, and a wrong simulation)."""
    for item in sets:
        key, _, value = item.partition("=")
        if key.strip() == "batching.microbatch_size":
            return int(value)
    return default


def _globs(text: str) -> list[str]:
    return [g.strip() for g in text.split(",") if g.strip()]


# The order rows run in: what a short budget (`--budget-s`) must not lose first. The table keeps the order
# of `all_rows` (by model).
RUN_ORDER = (
    "dense-1gpu",
    "titan-dense-1gpu",
    "dense-fsdp",
    "titan-dense-fsdp",
    "moe-1gpu",
    "titan-moe-1gpu",
    "moe-fsdp-ep",
    "titan-moe-fsdp-ep",
    "moe-fsdp",
    "titan-moe-fsdp",
    "dense-fsdp@ray",
    "moe-fsdp-ep@ray",
    "moe-pp-zbv",
    "dense-pp-zbv",
    "dense-pp-1f1b",
    "moe-pp-1f1b",
    "dense-pp-dualpipev",
    "dense-hsdp",
    "dense-ddp",
    "moe-ddp",
    "moe-ddp-ep",
    "moe-hsdp-ep",
    "dense-tp-fsdp",
    "titan-dense-tp-fsdp",
    "dense-cp-fsdp",
)


def select(rows: list[Row], args: argparse.Namespace) -> list[Row]:
    """The rows `--rows` and `--launchers` choose, in run order."""
    globs = _globs(args.rows)
    launchers = set(_globs(args.launchers))
    chosen = [r for r in rows if any(fnmatch.fnmatchcase(r.id, g) for g in globs)]
    chosen = [r for r in chosen if r.framework != "d9d" or r.launcher in launchers]
    rank = {row_id: i for i, row_id in enumerate(RUN_ORDER)}
    # stable: the rest in table order, and a variant right after its base row
    return sorted(chosen, key=lambda r: rank.get(r.base_id, len(RUN_ORDER)))


# ---- what each row runs ----


def arch_of(row: Row, smoke: bool) -> dict[str, Any]:
    return (SMOKE_ARCHS if smoke else ARCHS)[row.model]


def d9d_job(row: Row, args: argparse.Namespace, row_dir: Path) -> dict[str, Any]:
    smoke = args.smoke
    arch = arch_of(row, smoke)
    job: dict[str, Any] = {
        "run": {"name": "bench-" + re.sub(r"[^A-Za-z0-9._-]", "-", row.id), "dir": str(row_dir / "run")},
        "mesh": dict(row.mesh),
        "batching": {"global_batch_size": global_batch(row, smoke), "microbatch_size": row.microbatch},
        "trainer": {"total_steps": total_steps(row, args)},
        "logging": {"progress_bar": "off", "period": 1000},
        "checkpointing": {"save_at_end": False, "period": None},
        "gradient_clipping": {"max_norm": None},
        "model": {
            "provider": "qwen3_moe" if row.model == "moe" else "qwen3",
            "options": {
                "architecture": {**arch, "max_position_embeddings": max(row.seq, SEQ)},
                "dtype": "float32" if smoke else "bfloat16",
            },
        },
        "data": {
            "provider": "throughput.data:RandomTokens",
            "options": {
                "vocab_size": arch["vocab_size"],
                "seq_len": row.seq,
                "probe_dir": str(row_dir / "probe"),
                **profile_options(row, args),
            },
        },
        "optimizer": {"provider": "adamw", "options": {"lr": LR, "weight_decay": 0.0}},
        "compile": {"enabled": not smoke},
    }
    if row.schedule is not None:
        job["pipelining"] = {"kind": row.schedule}
    if row.launcher == "ray":
        job["cluster"] = {
            "num_workers": row.gpus,
            "resources": {"cpus": args.cpus_per_rank, "gpus": 0 if smoke else 1},
            "max_failures": 0,  # a failing row fails once, it is not restarted
        }
    return job


def profiled(row: Row, args: argparse.Namespace) -> bool:
    """Whether `--profile` names this row (d9d rows only: the probe profiles, torchtitan has none)."""
    globs = _globs(args.profile)
    return row.framework == "d9d" and any(fnmatch.fnmatchcase(row.id, g) for g in globs)


def profile_window(args: argparse.Namespace) -> tuple[int, int]:
    """The profiled steps (first, last): after the timed steps and one profiler warm-up step."""
    first = args.warmup + args.steps + 2
    return first, first + args.profile_steps - 1


def total_steps(row: Row, args: argparse.Namespace) -> int:
    """The probe records a step when the next one starts (and writes the profile then): one step more than
    the last timed (or profiled) one."""
    if profiled(row, args):
        return profile_window(args)[1] + 1
    return args.warmup + args.steps + 1


def profile_options(row: Row, args: argparse.Namespace) -> dict[str, Any]:
    """The data provider's options that make the probe profile (`throughput.data:RandomTokens`)."""
    if not profiled(row, args):
        return {}
    first, last = profile_window(args)
    return {"profile_from": first, "profile_steps": last - first + 1, "profile_trace": args.profile_trace}


def torchrun(nproc: int, numa_binding: str | None, *module_and_args: str) -> list[str]:
    binding = [] if numa_binding is None else ["--numa-binding", numa_binding]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *binding,
        *module_and_args,
    ]


def row_command(
    row: Row, args: argparse.Namespace, row_dir: Path
) -> tuple[list[str], dict[str, Any] | list[str]]:
    """The command line of the row and what configured it (the d9d job, or torchtitan's flags)."""
    sets = [item for s in (*args.set, *row.sets) for item in ("--set", s)]
    if row.framework == "d9d":
        job = d9d_job(row, args, row_dir)
        path = row_dir / "job.yaml"
        path.write_text(yaml.safe_dump(job, sort_keys=False))
        if row.launcher == "ray":
            cmd = [sys.executable, "-m", "d9d.cli.main", "train", str(path), "--verbose", *sets]
            return cmd + (["--cpu"] if args.smoke else []), job
        return torchrun(row.gpus, args.numa_binding, "-m", "d9d.engine.launch", str(path), *sets), job
    flags = titan_flags(row, args, row_dir)
    return torchrun(row.gpus, args.numa_binding, "-m", "throughput.titan_train", *flags), flags


def titan_flags(row: Row, args: argparse.Namespace, row_dir: Path) -> list[str]:
    flavor = f"smoke-{row.model}" if args.smoke else row.model
    flags = [
        "--job.dump_folder",
        str(row_dir / "titan"),
        "--model.name",
        "d9d_bench",
        "--model.flavor",
        flavor,
        "--training.local_batch_size",
        str(row.microbatch),
        # the same sequences per step as d9d's row (the TP row's replica of 2 GPUs takes two local batches:
        # torchtitan accumulates them, as d9d runs two microbatches)
        "--training.global_batch_size",
        str(global_batch(row, args.smoke)),
        "--training.seq_len",
        str(row.seq),
        "--training.steps",
        str(args.warmup + args.steps),
        "--training.dtype",
        "float32" if args.smoke else "bfloat16",
        "--training.mixed_precision_param",
        "bfloat16",
        "--parallelism.data_parallel_shard_degree",
        str(row.mesh.get("data_parallel_shard", 1)),
        "--parallelism.expert_parallel_degree",
        str(row.mesh.get("expert_parallel", 1)),
        "--parallelism.tensor_parallel_degree",
        str(row.mesh.get("tensor_parallel", 1)),
        "--activation_checkpoint.mode",
        "none",
        "--optimizer.name",
        "AdamW",
        "--optimizer.implementation",
        "fused",
        "--optimizer.lr",
        str(LR),
        "--optimizer.weight_decay",
        "0.0",
        "--metrics.log_freq",
        "1",
    ]
    if not args.smoke:
        flags += ["--compile.enable", "--compile.components", "model,loss"]
    return flags


# ---- running a row ----


def child_env(args: argparse.Namespace, row_dir: Path, gpu: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if gpu is not None:  # a 1-GPU row run beside others (`--concurrent-1gpu`)
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    paths = [str(REPO), str(BENCH), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    # Ray gives a rank actor as many OpenMP threads as it reserved CPUs; the torchrun ranks get the same.
    env["OMP_NUM_THREADS"] = str(args.cpus_per_rank)
    env["D9D_BENCH_PROBE_DIR"] = str(row_dir / "probe")  # the torchtitan rows' recorder
    env.pop("RAY_ADDRESS", None)  # `d9d train` starts its own local instance
    if args.smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


# An exception's last traceback line, maybe behind a launcher's prefix (`[rank1]:`, Ray's `(Actor pid=…)`).
_EXCEPTION = re.compile(
    r"^(?:\[[^\]]*\]:?\s*|\([^)]*\)\s*)?([\w.]+(?:Error|Exception|Interrupt|Exit))\b:?(.*)$"
)


def first_exception(path: Path) -> str | None:
    """The first Python exception line of the row's output (with the two lines after it, where messages
    such as a configuration error continue), skipping the launcher's own `ChildFailedError`."""
    if not path.exists():
        return None
    lines = path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        match = _EXCEPTION.match(line.strip())
        if match and "ChildFailedError" not in match.group(1):
            more = [
                x.strip() for x in lines[i + 1 : i + 3] if x.startswith("  ") and not x.startswith("  File")
            ]
            return " ".join([line.strip(), *more])[:600]
    return None


def tail(path: Path, lines: int = LOG_TAIL_LINES, *, stopped: bool = False) -> list[str]:
    """The last `lines` lines of a row's log; of a row this script `stopped`, those before torchrun's own
    shutdown (its "closing signal SIGTERM" and the agent's traceback would fill the tail otherwise)."""
    if not path.exists():
        return []
    text = path.read_text(errors="replace").splitlines()
    if stopped:
        end = next((i for i, line in enumerate(text) if "closing signal SIGTERM" in line), len(text))
        text = text[:end]
    return [line[-400:] for line in text[-lines:]]


def group_processes(pgid: int, proc: Path = Path("/proc")) -> list[tuple[int, str]]:
    """(pid, command line) of each process of process group `pgid`, from /proc (Linux; none elsewhere)."""
    found: list[tuple[int, str]] = []
    for entry in proc.glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after its end
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pgid:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not readable
        found.append((int(entry.name), cmdline))
    return sorted(found)


STACK_LINES = 40  # per process: py-spy prints the main thread first, the frame a hang sits in on top


def python_stacks(
    processes: list[tuple[int, str]], dump: Callable[[int], str] | None
) -> dict[str, list[str]]:
    """Each training process's Python stack (`dump(pid)`, py-spy's by default) before a timed-out row is
    stopped, so the table says where it hung. Launchers (torchrun's agent) and compile workers are skipped."""
    if dump is None:
        return {}
    stacks: dict[str, list[str]] = {}
    for pid, cmdline in processes:
        if "python" not in cmdline or "torch.distributed.run" in cmdline or "compile_worker" in cmdline:
            continue
        try:
            text = dump(pid)
        except (OSError, subprocess.SubprocessError) as e:
            text = f"no stack: {e}"
        stacks[str(pid)] = [cmdline[:200], *text.splitlines()[:STACK_LINES]]
    return stacks


def py_spy_dump() -> Callable[[int], str] | None:
    """`py-spy dump --pid` (py-spy is on PATH, e.g. from the device bundle), or None without it."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None

    def dump(pid: int) -> str:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
        return done.stdout or done.stderr

    return dump


PY_SPY_RATE = 100  # samples per second
STEP_FRAME = "Trainer._run_step"  # the training step, as py-spy names the frame


def start_recorder(row: Row, args: argparse.Namespace, pid: int, raw: Path) -> subprocess.Popen[bytes] | None:
    """`py-spy record --gil --threads` of the row's whole process tree (`--py-spy` rows; py-spy on PATH):
    which thread holds each rank's GIL, and for how long (throughput/host_stacks.py)."""
    exe = shutil.which("py-spy")
    if exe is None or not any(fnmatch.fnmatchcase(row.id, g) for g in _globs(args.py_spy)):
        return None
    cmd = [exe, "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--threads", "--gil"]
    cmd += ["--rate", str(PY_SPY_RATE), "--format", "raw", "--output", str(raw)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finish_recorder(
    recorder: subprocess.Popen[bytes], row: Row, args: argparse.Namespace, raw: Path
) -> dict[str, Any]:
    """Stop py-spy (it writes its file on SIGINT), keep its raw file beside `--out` (gzipped: tens of MB as
    text), and summarize it: per rank process, each thread's GIL samples, those under the step, and its
    three commonest frames; and the step thread's commonest frames (inclusive share), so the breakdown
    survives where the raw file cannot travel."""
    if recorder.poll() is None:
        recorder.send_signal(signal.SIGINT)
    try:
        recorder.wait(timeout=60)
    except subprocess.TimeoutExpired:
        recorder.kill()
        return {"error": "py-spy did not stop"}
    if not raw.exists():
        return {"error": f"py-spy wrote nothing (exit code {recorder.returncode})"}
    if args.out:
        keep = Path(args.out).with_suffix(f".{re.sub(r'[^A-Za-z0-9._-]', '_', row.id)}.py-spy.txt.gz")
        with raw.open("rb") as src, gzip.open(keep, "wb") as dst:
            shutil.copyfileobj(src, dst)
    lines = raw.read_text(errors="replace").splitlines()
    per_process = thread_samples(lines, STEP_FRAME)
    in_step = step_samples(lines, STEP_FRAME)
    return {
        "rate_hz": PY_SPY_RATE,
        "step_frames": {
            pid: {
                "samples": s.total,
                "inclusive": [(name, round(n / s.total, 4)) for name, n in s.inclusive.most_common(40)],
            }
            for pid, s in in_step.items()
        },
        "processes": {
            pid: {
                name: {"samples": t.total, "in_step": t.in_step, "top": t.leaf.most_common(3)}
                for name, t in sorted(by_thread.items(), key=lambda item: -item[1].total)
            }
            for pid, by_thread in per_process.items()
        },
    }


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the row's process group (`d9d train` stops its ranks, torchrun its workers), then SIGKILL to
    what is left of it after 20 s. The group is the row's own session (`start_new_session`)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return  # nothing left in the group
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            if proc.poll() is None:
                time.sleep(0.2)
                continue
            try:
                os.killpg(proc.pid, 0)  # still members (e.g. a launcher's daemons)?
            except ProcessLookupError:
                return
            time.sleep(0.2)


def run_row(
    row: Row, args: argparse.Namespace, work: Path, timeout: float, gpu: int | None = None
) -> dict[str, Any]:
    row_dir = work / re.sub(r"[^A-Za-z0-9._-]", "_", row.id)
    shutil.rmtree(row_dir, ignore_errors=True)
    (row_dir / "probe").mkdir(parents=True)
    cmd, configured = row_command(row, args, row_dir)
    log = row_dir / "output.log"
    result: dict[str, Any] = {"command": " ".join(cmd), "config": configured, "log": str(log)}
    start = time.perf_counter()
    with log.open("wb") as out:
        # Own session: a timeout ends the whole tree (ranks, compile workers, a local Ray instance).
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=child_env(args, row_dir, gpu),
            start_new_session=True,
        )
        recorder = start_recorder(row, args, proc.pid, row_dir / "py-spy.txt")
        stacks: dict[str, list[str]] = {}
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = python_stacks(group_processes(proc.pid), py_spy_dump())
            stop_group(proc)
            rc = None
    result["wall_s"] = time.perf_counter() - start
    stop_group(proc)  # whatever the launcher left behind in its group (e.g. Ray daemons)
    if recorder is not None:
        result["host_threads"] = finish_recorder(recorder, row, args, row_dir / "py-spy.txt")
    records = read_records(row_dir / "probe")
    if rc != 0:
        result["error"] = f"timed out after {timeout:.0f} s" if rc is None else f"exited with code {rc}"
        cause = first_exception(log) or next(
            (c for c in map(first_exception, sorted((row_dir / "run" / "logs").glob("rank*.log"))) if c), None
        )
        if cause:
            result["error"] += f": {cause}"
        result["log_tail"] = tail(log, stopped=rc is None) + ray_rank_tails(row_dir)
        if stacks:
            result["stacks"] = stacks
        try:
            result["partial"] = summarize(row, records, args, require_complete=False) if records else None
        except ValueError as e:
            result["partial"] = str(e)
        return result
    try:
        result.update(summarize(row, records, args, require_complete=True))
    except ValueError as e:
        result["error"] = str(e)
        result["log_tail"] = tail(log)
    result["setup"] = setup_lines([log, *sorted((row_dir / "run" / "logs").glob("rank*.log"))])
    if profiled(row, args):
        result["profile"] = profile_summary(row, records, read_profiles(row_dir / "probe"), args)
    return result


# What the engine logs about how it set a rank up (the CPUs it bound, FSDP's units and reshard policy, what it
# compiled): kept in the row's entry, so a row says what it ran with, not only what it was configured with.
SETUP_LINE = re.compile(r" INFO \S+ (?:\[rank [^\]]*\] )?(?:cpu_affinity |fsdp[: ]|compile: )")


def setup_lines(logs: list[Path], limit: int = 24) -> list[str]:
    """The engine's set-up lines of the row's output and its Ray ranks' logs (the rank prefix kept, the
    timestamp dropped), each once, in order."""
    seen: dict[str, None] = {}
    for path in logs:
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if SETUP_LINE.search(line):
                    seen.setdefault(line.split(" INFO ", 1)[-1].strip(), None)
    return list(seen)[:limit]


def ray_rank_tails(row_dir: Path) -> list[str]:
    lines: list[str] = []
    for path in sorted((row_dir / "run" / "logs").glob("rank*.log")):
        lines += [f"[{path.name}] {line}" for line in tail(path, 8)]
    return lines


# ---- numbers of a row ----


def summarize(
    row: Row, records: list[dict[str, Any]], args: argparse.Namespace, require_complete: bool
) -> dict[str, Any]:
    if len(records) != row.gpus and require_complete:
        raise ValueError(f"{len(records)} of {row.gpus} ranks wrote a record")
    timed = range(args.warmup + 1, args.warmup + args.steps + 1)
    per_step = []
    for step in timed:
        times = [r["step_s"][step] for r in records if step in r["step_s"]]
        if len(times) == len(records) and times:
            per_step.append(max(times))
    if not per_step:
        raise ValueError(f"no timed step (steps {timed.start}..{timed.stop - 1}) was recorded by every rank")
    if require_complete and len(per_step) < len(timed):
        raise ValueError(f"only {len(per_step)} of {len(timed)} timed steps were recorded by every rank")
    step_s = statistics.median(per_step)
    tokens = global_batch(row, args.smoke) * row.seq
    tps = tokens / step_s
    peaks = [p for r in records for s, p in r["peak_gib"].items() if s >= 2 and p is not None]
    cuda = any(r["device"] != "cpu" for r in records)
    arch = arch_of(row, args.smoke)
    out: dict[str, Any] = {
        "device": records[0]["device"],
        "median_step_s": step_s,
        "step_s": per_step,
        # What a run feels is the mean: a few stalled steps (a rank's garbage collection holding the others
        # at the next collective) leave the median alone.
        "mean_step_s": statistics.mean(per_step),
        "max_step_s": max(per_step),
        "tokens_per_step": tokens,
        "tokens_per_s": tps,
        "tokens_per_s_per_gpu": tps / row.gpus,
        "mfu": tps / row.gpus * flops_per_token(arch, row.model == "moe", row.seq) / (PEAK_TFLOPS * 1e12)
        if cuda
        else None,
        "peak_gib": max(peaks) if peaks else None,
        "peak_gib_per_rank": [
            max((p for s, p in r["peak_gib"].items() if s >= 2 and p is not None), default=None)
            for r in records
        ],
    }
    if row.schedule is not None:
        from throughput.bubble import pipeline_bubble  # imports d9d's simulator

        microbatches = global_batch(row, args.smoke) // row.data_parallel // row.microbatch
        out["pipeline"] = pipeline_bubble(records, timed, row.schedule, row.pp, microbatches)
    return out


def profile_summary(
    row: Row, records: list[dict[str, Any]], profiles: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """The row's `profile` entry: every rank's breakdown (the heaviest kernels of rank 0 only: a small JSON),
    the spread over ranks, and the slowest rank of each timed step."""
    first, last = profile_window(args)
    out: dict[str, Any] = {"steps": [first, last]}
    errors = [f"rank {p['rank']}: {p['error']}" for p in profiles if "error" in p]
    if len(profiles) != row.gpus:
        errors.append(f"{len(profiles)} of {row.gpus} ranks wrote a profile")
    if errors:
        out["error"] = "; ".join(errors)
    reports = [{"rank": p["rank"], **p["report"]} for p in profiles if "report" in p]
    if not reports:
        return out
    for report in reports[1:]:
        report.pop("top_kernels_ms_per_step", None)
    out["ranks"] = reports
    out["across_ranks"] = across_ranks(reports)
    timed = range(args.warmup + 1, args.warmup + args.steps + 1)
    out["slowest_rank_per_step"] = [
        max(records, key=lambda r: r["step_s"][step])["rank"]
        for step in timed
        if records and all(step in r["step_s"] for r in records)
    ]
    trace = next((p["trace"] for p in profiles if "trace" in p), None)
    if trace:
        out["trace"] = trace
    return out


def profile_sections(results: list[dict[str, Any]]) -> str:
    """The profiled rows' breakdowns, one section each, for below the table ('' when none)."""
    sections = []
    for r in results:
        p = r.get("profile")
        if not p:
            continue
        steps = f"steps {p['steps'][0]}..{p['steps'][1]}"
        if "ranks" not in p:
            sections.append(f"profile {r['id']} ({steps}): {p.get('error', 'no profile')}")
            continue
        n = len(p["ranks"])
        head = f"profile {r['id']} ({steps}, {n} rank{'s' * (n != 1)}, {p['ranks'][0]['source']})"
        if "error" in p:
            head += f" [{p['error']}]"
        if "trace" in p:
            head += f"; rank 0 trace: {p['trace']}"
        sections.append(f"{head}\n{render_ranks(p)}")
    return "\n\n".join(sections)


# ---- the table ----


def add_ratios(results: list[dict[str, Any]]) -> None:
    """`scaling` and `x_titan` of every measured row, against the rows of `results` it is compared with
    (module docs); a ratio whose reference did not run, or ran another sequence length, is left out."""
    done = {r["id"]: r for r in results if "tokens_per_s" in r}

    def ratio(row: dict[str, Any], ref_id: str) -> float | None:
        ref = done.get(ref_id)
        if ref is None or ref["seq"] != row["seq"]:
            return None
        return float(row["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"])

    for r in results:
        for key in ("scaling", "x_titan", "x_torchrun", "x_base"):
            r.pop(key, None)
        if "tokens_per_s" not in r:
            continue
        # every reference is the row of the same `--repeat` pass
        stem, suffix = split_pass(r["id"])
        twin = stem.removesuffix("@ray") + suffix
        if r["launcher"] == "ray" and (x_torchrun := ratio(r, twin)) is not None:
            r["x_torchrun"] = x_torchrun
        if base_id(stem) != stem and (x_base := ratio(r, base_id(stem) + suffix)) is not None:
            r["x_base"] = x_base
        model = r["model"]
        # torchtitan's row of the same layout where it has one, else its FSDP (x EP) row
        same_layout = f"titan-{base_id(stem).partition('@')[0]}{suffix}"
        fsdp_row = (f"titan-{model}-fsdp-ep" if model == "moe" else f"titan-{model}-fsdp") + suffix
        titan_n = same_layout if same_layout in done else fsdp_row
        titan_1 = f"titan-{model}-1gpu{suffix}"
        scaling = ratio(r, titan_1 if r["framework"] == "torchtitan" else f"{model}-1gpu{suffix}")
        x_titan = ratio(r, titan_1 if r["gpus"] == 1 else titan_n)
        if x_titan is not None and done[titan_1 if r["gpus"] == 1 else titan_n]["gpus"] != r["gpus"]:
            x_titan = None  # torchtitan's N-GPU row of another run with another N
        if scaling is not None:
            r["scaling"] = scaling
        if x_titan is not None:
            r["x_titan"] = x_titan


def table(results: list[dict[str, Any]]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [
        "| row | model | layout | GPUs | launcher | tok/s | tok/s/GPU | MFU | peak GiB | scaling | vs titan "
        "| bubble measured / sim / sim unit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        launcher = r["launcher"] if r["framework"] == "d9d" else "torchrun (torchtitan)"
        if "x_torchrun" in r:
            launcher += f" ({r['x_torchrun']:.2f}x torchrun)"
        if "x_base" in r:
            launcher += f" ({r['x_base']:.2f}x base)"
        head = f"| {r['id']} | {MODEL_NAMES[r['model']]} | {r['layout']} | {r['gpus']} | {launcher} |"
        if "tokens_per_s" not in r:
            reason = r.get("error", "not run").replace("|", "/")[:200]
            lines.append(f"{head} failed: {reason} | | | | | | |")
            continue
        p = r.get("pipeline") or {}
        bubble = "-"
        if "bubble_measured" in p:
            bubble = f"{p['bubble_measured']:.1%} / {p['bubble_sim']:.1%} / {p['bubble_sim_unit']:.1%}"
        elif p:
            bubble = p.get("error", "-")
        mfu = r.get("mfu")
        x_titan = f"{r['x_titan']:.2f}x" if "x_titan" in r else "-"
        lines.append(
            f"{head} {r['tokens_per_s']:,.0f} | {r['tokens_per_s_per_gpu']:,.0f} | "
            f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | {num(r.get('peak_gib'), '.1f')} | "
            f"{num(r.get('scaling'), '.2f')} | {x_titan} | {bubble} |"
        )
    return "\n".join(lines)


def stage_times(results: list[dict[str, Any]]) -> str:
    """Per pipeline row, each stage's measured work per microbatch (the medians of its F, B, I and W passes
    summed, ms): what `model.options.parallel.stage_split: {kind: layers}` is chosen from."""
    lines = []
    for r in results:
        medians = (r.get("pipeline") or {}).get("pass_median_s") or {}
        per_stage: dict[int, float] = {}
        for key, seconds in medians.items():  # "3F": stage 3's forward
            stage = int(key[:-1])
            per_stage[stage] = per_stage.get(stage, 0.0) + seconds
        if per_stage:
            cells = ", ".join(f"{s}: {1e3 * t:.1f}" for s, t in sorted(per_stage.items()))
            lines.append(f"{r['id']}: stage ms per microbatch {cells}")
    return "\n".join(lines)


def environment(args: argparse.Namespace, n: int) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpus": n,
        "smoke": args.smoke,
        "host_cpus": os.cpu_count(),
    }
    for package in ("torchtitan", "triton", "ray"):
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = None
    if shutil.which("nvidia-smi") and not args.smoke:
        try:  # names without creating a CUDA context in this process
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            info["nvidia_smi"] = out.stdout.strip().splitlines()
        except (OSError, subprocess.TimeoutExpired):
            pass
    return info


def default_out(env: dict[str, Any]) -> Path:
    name = re.sub(r"[^a-z0-9]+", "-", (env.get("device") or "gpu").lower()).strip("-")
    day = time.strftime("%Y-%m-%d", time.gmtime())
    return BENCH / "results" / f"multi_gpu_{name}_{env['gpus']}gpu_{day}.json"


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    tmp.replace(path)


def run_entry(
    row: Row,
    args: argparse.Namespace,
    work: Path,
    time_left: Callable[[], float],
    label: str,
    gpu: int | None = None,
) -> dict[str, Any]:
    """The row's result entry: run under what is left of `--budget-s`, or recorded as skipped."""
    entry: dict[str, Any] = {**asdict(row)} | ({} if gpu is None else {"gpu": gpu})
    left = time_left()
    if left < 30:
        entry["error"] = "skipped: out of the --budget-s time"
        return entry
    print(f"{label} {row.id}: {row.layout} ({row.framework}, {row.launcher})", flush=True)
    entry.update(run_row(row, args, work, min(args.timeout_per_row, left), gpu))
    return entry


def concurrent_rows(rows: list[Row], args: argparse.Namespace, n: int) -> list[Row]:
    """The rows `--concurrent-1gpu` runs side by side: 1-GPU rows under torchrun (a Ray row starts a local
    Ray instance of its own, which does not share a host with another), on a host of several GPUs."""
    if not args.concurrent_1gpu or args.smoke or n < 2:
        return []
    return [r for r in rows if r.gpus == 1 and r.launcher == "torchrun"]


def run_concurrently(
    rows: list[Row], args: argparse.Namespace, work: Path, n: int, time_left: Callable[[], float]
) -> Iterator[dict[str, Any]]:
    """`rows` (1-GPU each) at most `n` at a time, each pinned to a free GPU; entries as rows finish. A 1-GPU
    row shares nothing with another but the host's CPUs and the compile cache, so its step is the same:
    this saves a 4-GPU call three quarters of its 1-GPU rows' time."""
    free: queue.Queue[int] = queue.Queue()
    for gpu in range(n):
        free.put(gpu)

    def one(row: Row) -> dict[str, Any]:
        gpu = free.get()  # the pool has n workers, so one is always free here
        try:
            return run_entry(row, args, work, time_left, f"[GPU {gpu}]", gpu)
        finally:
            free.put(gpu)

    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as pool:
        for done in concurrent.futures.as_completed([pool.submit(one, row) for row in rows]):
            yield done.result()


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main_run(args: argparse.Namespace) -> int:
    n = args.gpus or (2 if args.smoke else gpu_count())
    if n < 1:
        print("multi_gpu: no GPU visible (use --smoke for the CPU check)", file=sys.stderr)
        return 2
    table_order = {row.id: i for i, row in enumerate(all_rows(n, args))}
    if args.repeat < 1:
        print(f"multi_gpu: --repeat {args.repeat}: expected 1 or more", file=sys.stderr)
        return 2
    rows = repeated(select(all_rows(n, args), args), args.repeat)
    if args.list:
        for row in rows:
            print(f"{row.id:24s} {row.framework:10s} {row.launcher:8s} {row.gpus} GPU(s)  {row.layout}")
        return 0
    if not rows:
        print(
            f"multi_gpu: no row matches --rows {args.rows!r} / --launchers {args.launchers!r}",
            file=sys.stderr,
        )
        return 2
    env = environment(args, n)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="d9d-multi-gpu-"))
    out = Path(args.out) if args.out else None
    if out is None and args.smoke:
        out = work / "multi_gpu_smoke.json"
    print(f"{len(rows)} rows on {n} GPU(s); work dir {work}; {json.dumps(env)}", flush=True)
    deadline = time.perf_counter() + args.budget_s if args.budget_s else None
    results: list[dict[str, Any]] = []

    def time_left() -> float:
        return deadline - time.perf_counter() if deadline is not None else float("inf")

    def record(entry: dict[str, Any]) -> None:
        nonlocal out
        results.append(entry)
        if "device" in entry and "device" not in env:
            env["device"] = entry["device"]
        add_ratios(results)
        brief = {k: v for k, v in entry.items() if k in ("id", "tokens_per_s", "peak_gib", "wall_s", "error")}
        print(json.dumps(brief), flush=True)
        if "log_tail" in entry:
            print("\n".join("    " + line for line in entry["log_tail"][-12:]), flush=True)
        for pid, lines in entry.get("stacks", {}).items():
            print(f"    stack of pid {pid}:", *("      " + line for line in lines[:16]), sep="\n", flush=True)
        if out is None:
            out = default_out(env) if "device" in env else None
        if out is not None:
            write_json(out, {**env, "args": vars(args), "results": results})

    together = concurrent_rows(rows, args, n)
    if together:
        print(f"running {len(together)} 1-GPU rows {n} at a time, one per GPU", flush=True)
        for entry in run_concurrently(together, args, work, n, time_left):
            record(entry)
    for i, row in enumerate(r for r in rows if r not in together):
        record(run_entry(row, args, work, time_left, f"[{i + 1}/{len(rows) - len(together)}]"))
    if out is None:
        out = default_out(env)
    results.sort(key=lambda r: (table_order[split_pass(r["id"])[0]], r["repeat"]))
    write_json(out, {**env, "args": vars(args), "results": results})
    sections = f"{table(results)}\n{stage_times(results)}\n{profile_sections(results)}"
    print(f"\n{json.dumps(env)}\n{sections}\nresults: {out}", flush=True)
    return 0


def main_merge(args: argparse.Namespace) -> int:
    runs = [json.loads(Path(f).read_text()) for f in args.merge]
    # A row in several runs (a rerun): the later measurement wins, a later failure does not replace one.
    merged: dict[str, dict[str, Any]] = {}
    for run in runs:
        for r in run["results"]:
            if "tokens_per_s" in r or "tokens_per_s" not in merged.get(r["id"], {}):
                merged[r["id"]] = r
    results = list(merged.values())
    add_ratios(results)
    envs = [{k: v for k, v in run.items() if k not in ("results", "args")} for run in runs]
    if args.out:
        write_json(Path(args.out), {"runs": envs, "merged_from": args.merge, "results": results})
    print("\n".join(json.dumps(e) for e in envs) + "\n" + table(results), flush=True)
    if sections := profile_sections(results):
        print(sections, flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=None, help="N (default: every visible GPU; --smoke: 2)")
    parser.add_argument(
        "--rows", default="*", help="comma-separated globs over row ids (default: all); --list"
    )
    parser.add_argument(
        "--launchers", default="torchrun,ray", help="d9d launchers to keep: torchrun, ray or both"
    )
    parser.add_argument(
        "--ray-rows",
        default=DEFAULT_RAY_ROWS,
        help="d9d rows that also run through `d9d train` on Ray (globs)",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1: compile)")
    parser.add_argument("--timeout-per-row", type=float, default=420.0)
    parser.add_argument("--budget-s", type=float, default=None, help="skip the rows that would start past it")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the selected rows this many times, every second pass in reverse order (ids `<id>#<pass>`)",
    )
    parser.add_argument(
        "--pp-microbatch", type=int, default=2, help="sequences per microbatch on pipeline rows"
    )
    parser.add_argument(
        "--microbatch",
        type=int,
        default=BATCH,
        help=f"sequences per microbatch on the other rows (d9d microbatch_size, torchtitan "
        f"local_batch_size), a divisor of {BATCH}: each GPU's {BATCH} sequences per step then run as "
        "gradient accumulation",
    )
    parser.add_argument("--cp-seq", type=int, default=8192, help="sequence length of the CP row")
    parser.add_argument("--cpus-per-rank", type=int, default=4, help="Ray CPUs (and OMP threads) per rank")
    parser.add_argument(
        "--numa-binding",
        choices=("node", "socket", "exclusive", "core-complex"),
        default=None,
        help="torchrun's --numa-binding for every torchrun row, d9d's and torchtitan's (default: none)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="d9d job override")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[;KEY=VALUE]",
        help="also run every multi-GPU d9d row with these overrides, as row <id>+NAME (repeatable)",
    )
    parser.add_argument(
        "--variants-on-1gpu",
        action="store_true",
        help="run the variants on the 1-GPU d9d rows too (settings that apply without sharding)",
    )
    parser.add_argument(
        "--profile",
        default="",
        metavar="GLOB[,GLOB]",
        help="d9d rows to profile on every rank after their timed steps (module docs)",
    )
    parser.add_argument(
        "--py-spy",
        default="",
        metavar="GLOB[,GLOB]",
        help="rows whose processes `py-spy record --gil --threads` samples (module docs)",
    )
    parser.add_argument("--profile-steps", type=int, default=3, help="steps the profiler records (>= 1)")
    parser.add_argument(
        "--profile-trace", action="store_true", help="also write each rank's Chrome trace (gzipped)"
    )
    parser.add_argument(
        "--concurrent-1gpu",
        action="store_true",
        help="run the 1-GPU torchrun rows first, side by side, one per GPU",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CPU ranks on gloo, tiny shapes: checks the script"
    )
    parser.add_argument("--work-dir", default=None, help="rows' jobs, logs and records (default: a temp dir)")
    parser.add_argument("--out", default=None, help="results JSON (default under benchmarks/results/)")
    parser.add_argument("--list", action="store_true", help="print the selected rows and exit")
    parser.add_argument("--merge", nargs="+", default=None, help="--out files to print as one table")
    args = parser.parse_args()
    if str(REPO) not in sys.path:
        sys.path.insert(1, str(REPO))  # this checkout's d9d for the parent's own imports (the simulator)
    if args.merge:
        return main_merge(args)
    if args.profile_steps < 1:
        parser.error("--profile-steps must be >= 1")
    if args.microbatch < 1 or BATCH % args.microbatch:
        parser.error(f"--microbatch {args.microbatch}: expected a divisor of {BATCH}")
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step compiles; torchtitan's first interval is step 2)")
    try:
        with_variants([], args.variant)  # malformed or repeated variants fail here, before any row runs
    except ValueError as e:
        parser.error(str(e))
    if args.smoke:
        args.steps, args.warmup = min(args.steps, 2), 1
        args.cpus_per_rank = 1
    return main_run(args)


if __name__ == "__main__":
    sys.exit(main())
