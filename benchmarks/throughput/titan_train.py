"""torchtitan 0.2.2's own trainer (`torchtitan.train.Trainer` run by `torchtitan.train.main`) on the
benchmark's shapes and random tokens: the torchtitan rows of `benchmarks/multi_gpu.py`.

    torchrun --standalone --nproc-per-node N -m throughput.titan_train --model.name d9d_bench \\
        --model.flavor dense --parallelism.data_parallel_shard_degree N [...torchtitan's own flags]

(with `benchmarks/` on PYTHONPATH, and `D9D_BENCH_PROBE_DIR` naming where each rank writes its record).
Every flag after the module is torchtitan's own `JobConfig`, parsed by its `ConfigManager`; the
parallelism (`--parallelism.data_parallel_shard_degree`, `--parallelism.expert_parallel_degree`), the
compile (`--compile.enable --compile.components model,loss`), activation checkpointing, dtypes and the
optimizer are chosen there by the benchmark.

What is ours: a `TrainSpec` registered as `d9d_bench` before torchtitan's `main` runs, which is torchtitan's
own Qwen3 spec (`Qwen3Model`, `parallelize_qwen3`, its optimizers, LR schedulers and cross-entropy loss)
with:
- model flavors `dense` and `moe` = the benchmark shapes of `common.ARCHS` (`titan_peer.model_args`), and
  `smoke-dense` / `smoke-moe` = `common.SMOKE_ARCHS`;
- a data loader of uniform random tokens (per data-parallel rank) instead of its Hugging Face dataset and
  tokenizer, which cannot be downloaded on the benchmark machines (and `datasets` is not installed there:
  `titan_peer` stands in for the imports torchtitan makes of it);
- a metrics processor that, besides torchtitan's own log line, writes each rank's step times and peak
  memory in the format of `throughput.probe` (`step_s`, `peak_gib` by step). Give `--metrics.log_freq 1`:
  it records at the steps torchtitan logs. A step's time is the interval between two consecutive logs
  (each ends the step with a host sync on the gradient norm; the record's own write is left out), its peak
  the allocator's high-water mark since the previous log (torchtitan resets it after each).
No validator and no checkpoint state adapter. The rest (FSDP2 mixed precision, expert parallel, compile,
gradient clipping, its loss normalization, its garbage-collection control) is torchtitan's trainer as it
ships.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from throughput.common import ARCHS, SMOKE_ARCHS
from throughput.probe import write_record
from throughput.titan_peer import _stub_unused_imports
from throughput.titan_peer import model_args as titan_model_args

SPEC_NAME = "d9d_bench"
# the Qwen3 shapes only: the spec is torchtitan's qwen3, whose model args the other families' shapes lack
FLAVORS = {
    **{name: ARCHS[name] for name in ("dense", "moe")},
    **{f"smoke-{name}": arch for name, arch in SMOKE_ARCHS.items()},
}
PROBE_ENV = "D9D_BENCH_PROBE_DIR"


def register() -> None:
    """Register the `d9d_bench` train spec with torchtitan (in every rank, before its trainer looks it up)."""
    _stub_unused_imports()
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.models import qwen3
    from torchtitan.protocols.train_spec import register_train_spec

    class RandomTokenLoader(BaseDataLoader):
        """`(local_batch_size, seq_len)` uniform random ids, a stream per data-parallel rank."""

        def __init__(self, dp_rank: int, batch: int, seq_len: int, vocab_size: int) -> None:
            self.generator = torch.Generator().manual_seed(dp_rank)
            self.batch, self.seq_len, self.vocab_size = batch, seq_len, vocab_size

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                shape = (self.batch, self.seq_len + 1)
                ids = torch.randint(0, self.vocab_size, shape, generator=self.generator)
                yield {"input": ids[:, :-1]}, ids[:, 1:]

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            return None

    def build_dataloader(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any) -> Any:
        t = job_config.training
        vocab = FLAVORS[job_config.model.flavor]["vocab_size"]
        return RandomTokenLoader(dp_rank, t.local_batch_size, t.seq_len, vocab)

    class RecordingMetrics(MetricsProcessor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            out = Path(os.environ[PROBE_ENV])
            out.mkdir(parents=True, exist_ok=True)
            self.record: dict[str, Any] = {
                "rank": rank,
                "device": torch.cuda.get_device_name(),
                "step_s": {},
                "peak_gib": {},
                "pipeline": {},
            }
            self.path = out / f"rank{rank}.json"
            self.last: tuple[int, float] | None = None

        def log(self, step: int, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()  # the step's work is done: its gradient norm came back to the host
            peak = torch.cuda.max_memory_allocated() / 2**30  # since the previous log, which reset it
            super().log(step, *args, **kwargs)
            if self.last is not None and self.last[0] == step - 1:
                self.record["step_s"][step] = now - self.last[1]
            self.record["peak_gib"][step] = peak
            write_record(self.path, self.record)
            self.last = (step, time.perf_counter())  # the next step's clock starts after this file's write

    def build_metrics(
        job_config: Any, parallel_dims: Any, model_args: Any = None, tag: str | None = None
    ) -> Any:
        return RecordingMetrics(job_config, parallel_dims, tag)

    spec = dataclasses.replace(
        qwen3.get_train_spec(),
        model_args={name: titan_model_args(arch) for name, arch in FLAVORS.items()},
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=None,
        build_validator_fn=None,
        build_metrics_processor_fn=build_metrics,
        state_dict_adapter=None,
    )
    register_train_spec(SPEC_NAME, spec)


def main() -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            "torchtitan's trainer needs CUDA (it has no CPU device path); this row cannot run here"
        )
    register()
    from torchtitan.train import Trainer
    from torchtitan.train import main as titan_main

    titan_main(Trainer)


if __name__ == "__main__":
    main()
