"""Throughput of d9d's streaming safetensors reader/writer against the raw `safetensors` library.

Both sides handle the same synthetic state in the same process, `--repeats` runs each, raw and d9d
back to back (which one goes first alternates by round) so drift (page cache, other load) hits both
alike; the median and the best run are reported
(on a shared machine the best run is the least disturbed one). Ratios are the median over runs of
raw time / d9d time of the same round (robust to load that drifts between rounds), and best/best.

- Reads copy every tensor into a preallocated destination, as loading into a model does: raw
  `load_file` returns lazily mmapped tensors, so timing it alone would measure nothing. The file was
  just written, so it is in the page cache: this measures the software path, not a disk.
- Writes start after deleting the previous output and an `os.sync()` (both untimed), so dirty pages
  of the previous run do not throttle the next. d9d fsyncs by default (durable commits): that is
  compared with raw `save_file` + fsync, and d9d with `fsync=False` with plain `save_file`.

    .venv/bin/python benchmarks/state_io.py --total-mib 1024 --tensor-mib 32 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from d9d.state import Identity, read_model_state, save_model_state


def timed(fn: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
    if setup is not None:
        setup()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def clear(path: Path) -> None:
    """Remove the previous run's output and flush dirty pages, outside the timed region."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    os.sync()


def raw_save(state: dict[str, torch.Tensor], path: Path, fsync: bool) -> None:
    save_file(state, str(path))
    if fsync:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def d9d_save(state: dict[str, torch.Tensor], path: Path, fsync: bool) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    save_model_state(path, state, max_shard_bytes=2 * nbytes, fsync=fsync)  # one file, like raw


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--tensor-mib", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    count = args.total_mib // args.tensor_mib
    numel = args.tensor_mib * 1024 * 1024 // 2
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(numel, generator=g).to(torch.bfloat16) for i in range(count)}
    dst = {k: torch.empty_like(t) for k, t in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    mapper = Identity(state)
    root = Path(tempfile.mkdtemp(prefix="d9d-bench-", dir=args.dir))
    raw_path, ours_path = root / "raw.safetensors", root / "ours"

    def raw_read() -> None:
        for k, t in load_file(str(raw_path)).items():
            dst[k].copy_(t)

    def d9d_read() -> None:
        for k, t in read_model_state(ours_path, mapper):
            dst[k].copy_(t)

    runs: dict[str, Callable[[], float]] = {
        "raw write": lambda: timed(lambda: raw_save(state, raw_path, False), lambda: clear(raw_path)),
        "d9d write (fsync=False)": lambda: timed(
            lambda: d9d_save(state, ours_path, False), lambda: clear(ours_path)
        ),
        "raw write + fsync": lambda: timed(lambda: raw_save(state, raw_path, True), lambda: clear(raw_path)),
        "d9d write (fsync)": lambda: timed(
            lambda: d9d_save(state, ours_path, True), lambda: clear(ours_path)
        ),
        "raw read + copy": lambda: timed(raw_read),
        "d9d read + copy": lambda: timed(d9d_read),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    try:
        names = list(runs)
        pairs = list(zip(names[::2], names[1::2], strict=True))  # (raw, d9d) of one operation
        for round_ in range(args.repeats):
            for pair in pairs:
                # Odd rounds run d9d first, so neither side always follows the other's dirty pages.
                for name in pair if round_ % 2 == 0 else pair[::-1]:
                    times[name].append(runs[name]())
        d9d_read()
        assert all(torch.equal(dst[k], state[k]) for k in state)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    best = {k: nbytes / min(v) / 1e9 for k, v in times.items()}
    print(f"state: {count} x {args.tensor_mib} MiB bf16 = {nbytes / 2**30:.2f} GiB, {args.repeats} runs each")
    print(f"  {'GB/s':26s} {'median':>7s} {'best':>7s}")
    for key in times:
        samples = " ".join(f"{nbytes / t / 1e9:.2f}" for t in times[key])
        print(f"  {key:26s} {med[key]:7.2f} {best[key]:7.2f}   runs: {samples}")
    for label, ours, raw in (
        ("read  d9d/raw", "d9d read + copy", "raw read + copy"),
        ("write d9d/raw", "d9d write (fsync=False)", "raw write"),
        ("write d9d/raw, both fsync", "d9d write (fsync)", "raw write + fsync"),
    ):
        paired = statistics.median(r / o for r, o in zip(times[raw], times[ours], strict=True))
        print(f"  ratio {label:26s} {paired:5.2f}x paired median  {best[ours] / best[raw]:5.2f}x best/best")


if __name__ == "__main__":
    main()
