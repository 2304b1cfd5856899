"""Sleep and wake of the real engine (`d9d.engine.Trainer`) for Qwen3-0.6B on one GPU: how long each takes,
and how much of the device memory the job held a sleep gives back.

The trainer runs `--steps` steps (bf16 weights, AdamW, the benchmark batches of `throughput/d9d_peer.py`);
at step `--sleep-at` it receives `--cycles` rounds of SLEEP then WAKE through its command path (the same
commands `TrainingJob.sleep()`/`wake()` send), then RESUME, and trains to the end. Per cycle, from the
engine's own report (`d9d.engine.offload`): sleep and wake seconds, bytes moved, `memory_allocated` before
and after the sleep; measured here while asleep: `memory_reserved` (the caching allocator's hold) and the
device's used memory (`mem_get_info`, which also counts the CUDA context, which no sleep can free).

"Held" is `memory_allocated` at the step boundary before the sleep (parameters, gradients, optimizer
state, and whatever else the engine keeps between steps); the target is ≥ 95% freed and wake ≤ 2 s.
With `--reference` an uninterrupted run of the same config follows, and the per-step losses are compared
bit for bit (reported, not asserted: the tests assert it).

    python benchmarks/sleep_wake.py [--steps 6] [--sleep-at 3] [--cycles 3] [--out FILE]
    python benchmarks/sleep_wake.py --tiny          # CPU smoke test with a tiny shape
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from throughput.common import ARCHS, BATCH, LR, SEQ, TINY, TINY_BATCH, TINY_SEQ

from d9d.core import DeviceMeshParameters, DistributedContext
from d9d.engine.checkpoint import LocalRunReporter
from d9d.engine.config import parse_config
from d9d.engine.runtime import Command, CommandKind, MetricPoint
from d9d.engine.trainer import Trainer


def _config(tiny: bool, steps: int) -> dict[str, Any]:
    arch = TINY if tiny else ARCHS["dense"]
    batch, seq = (TINY_BATCH, TINY_SEQ) if tiny else (BATCH, SEQ)
    return {
        "run": {"name": "sleep-wake", "dir": tempfile.mkdtemp(prefix="d9d-bench-sleep-")},
        "batching": {"global_batch_size": batch, "microbatch_size": batch},
        "trainer": {"total_steps": steps},
        "logging": {"progress_bar": "off", "period": 1000, "tracker": {"kind": "null"}},
        "checkpointing": {"period": None, "save_at_end": False},
        "gradient_clipping": {"max_norm": None},
        "model": {
            "provider": "qwen3",
            "options": {
                "architecture": {**arch, "max_position_embeddings": seq},
                "dtype": "float32" if tiny else "bfloat16",
            },
        },
        "data": {
            "provider": "throughput.data:RandomTokens",
            "options": {"vocab_size": arch["vocab_size"], "seq_len": seq},
        },
        "optimizer": {"provider": "adamw", "options": {"lr": LR, "weight_decay": 0.0}},
    }


@dataclass
class _Cycles:
    """Sends SLEEP, WAKE `cycles` times at `at`, then RESUME; measures the device while asleep."""

    root: Path
    at: int
    cycles: int
    device: torch.device
    script: list[list[Command]] = field(default_factory=list)
    health: list[dict[str, float]] = field(default_factory=list)
    asleep: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        sleep, wake = [Command(CommandKind.SLEEP)], [Command(CommandKind.WAKE)]
        for _ in range(self.cycles):
            self.script += [sleep, [], wake]  # the empty poll: measured while asleep
        self.script.append([Command(CommandKind.RESUME)])


class CyclingReporter(LocalRunReporter):
    def __init__(self, cycles: _Cycles) -> None:
        super().__init__(cycles.root, 1, self._record)
        self.cycles = cycles

    def _record(self, point: MetricPoint) -> None:
        if point.kind == "health" and "asleep" in point.values:
            self.cycles.health.append(dict(point.values))

    def commands(self, step: int) -> list[Command]:
        c = self.cycles
        if step != c.at or not c.script:
            return []
        batch = c.script.pop(0)
        if not batch and c.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(c.device)
            c.asleep.append(
                {
                    "allocated": torch.cuda.memory_allocated(c.device),
                    "reserved": torch.cuda.memory_reserved(c.device),
                    "device_used": total - free,
                }
            )
        return batch


def _train(tiny: bool, steps: int, cycles: _Cycles | None) -> tuple[list[float], dict[str, Any]]:
    config = parse_config(_config(tiny, steps))
    ctx = DistributedContext.create(DeviceMeshParameters())
    reporter = LocalRunReporter(config.checkpoint_dir, 1) if cycles is None else CyclingReporter(cycles)
    trainer = Trainer(config, ctx, reporter)
    trainer.setup()
    device = ctx.device
    before: dict[str, Any] = {}
    if cycles is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        before = {"device_total_gib": total / 2**30, "device_used_at_setup_gib": (total - free) / 2**30}
    result = trainer.train()
    return list(result.losses), before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sleep-at", type=int, default=3)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (CPU smoke test)")
    parser.add_argument("--reference", action="store_true", help="also run without sleeping; compare losses")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        parser.error("the 0.6B measurement needs a GPU; use --tiny for a CPU smoke test")
    if not 1 <= args.sleep_at < args.steps:
        parser.error("--sleep-at must be a step before the last")

    with socket.socket() as sock:  # a one-rank process group, as torchrun would describe it
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(port))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    cycles = _Cycles(Path(tempfile.mkdtemp()), args.sleep_at, args.cycles, device or torch.device("cpu"))
    losses, device_info = _train(args.tiny, args.steps, cycles)
    if cycles.script:
        raise RuntimeError("the run ended before every sleep/wake cycle was delivered")
    sleeps = [h for h in cycles.health if h["asleep"] > 0]
    wakes = [h for h in cycles.health if h["asleep"] == 0]
    rows = []
    for i, (s, w) in enumerate(zip(sleeps, wakes, strict=True)):
        row: dict[str, Any] = {
            "cycle": i,
            "sleep_s": s["sleep_s"],
            "wake_s": w["wake_s"],
            "offloaded_gib": s["offloaded_bytes"] / 2**30,
        }
        if "device_allocated_before" in s:
            held, after = s["device_allocated_before"], s["device_allocated_after"]
            row |= {
                "held_gib": held / 2**30,
                "allocated_asleep_gib": after / 2**30,
                "freed_fraction": (held - after) / held if held else None,
            }
        if i < len(cycles.asleep):
            row |= {f"{k}_asleep_gib": v / 2**30 for k, v in cycles.asleep[i].items()}
        rows.append(row)
    report: dict[str, Any] = {
        "model": "tiny" if args.tiny else "Qwen3-0.6B (bf16, AdamW)",
        "device": torch.cuda.get_device_name() if device is not None else "cpu",
        "cycles": rows,
        **device_info,
        "losses": losses,
    }
    if args.reference:
        # Two uninterrupted runs: on a GPU two plain runs need not agree bitwise (kernels that accumulate
        # with atomics), so the sleeping run is judged against the spread between them.
        reference, _ = _train(args.tiny, args.steps, None)
        again, _ = _train(args.tiny, args.steps, None)
        report["losses_equal_to_uninterrupted"] = reference == losses
        report["uninterrupted_runs_equal"] = reference == again
        for key, other in (("sleep_vs_uninterrupted", losses), ("between_uninterrupted", again)):
            report[f"max_loss_diff_{key}"] = max(abs(a - b) for a, b in zip(reference, other, strict=True))
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
