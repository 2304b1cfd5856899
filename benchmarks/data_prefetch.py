"""Step time with data loaded on the step thread against a background prefetch thread (CPU).

What the engine does with `data_loading.num_workers: 0` (load, then compute) and `num_workers: 1`
(`d9d.data.PrefetchingLoader` making the next steps while the current one computes), on the built-in text
provider and a small d9d Qwen3 training step (forward, backward, AdamW) in one process. Loading is made slow
in one of two ways, each per step:
  - `io`: a wait that releases the GIL (a network filesystem, object store or a remote dataset),
  - `cpu`: Python work that holds the GIL (a slow pure-Python tokenizer or preprocessing).
Prints the median step time of each, also without any extra delay (the provider's own tokenization and
collation).

    python benchmarks/data_prefetch.py --load-ms 40 --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from d9d.data.prefetch import PrefetchingLoader
from d9d.engine.builtin.causal_lm import CausalLMTask
from d9d.engine.builtin.text_data import TextDataProvider
from d9d.engine.providers import DataSetup
from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

Delay = Literal["none", "io", "cpu"]


class SlowSource:
    """The text provider with a fixed extra loading cost per step."""

    def __init__(self, provider: TextDataProvider, delay: Delay, load_s: float) -> None:
        self.provider, self.delay, self.load_s = provider, delay, load_s

    def next_step(self) -> list[Any]:
        if self.delay == "io":
            time.sleep(self.load_s)
        elif self.delay == "cpu":
            end = time.perf_counter() + self.load_s
            while time.perf_counter() < end:
                pass
        return self.provider.next_step()

    def state_dict(self) -> dict[str, Any]:
        return self.provider.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.provider.load_state_dict(state)


def build_provider(corpus: Path, microbatch: int) -> TextDataProvider:
    config = TextDataProvider.Config.model_validate(
        {"dataset": {"paths": [str(corpus)], "max_length": 128}, "pad_to_multiple_of": 128}
    )
    provider = TextDataProvider(config)
    provider.setup(DataSetup(0, 1, microbatch, 1, microbatch, seed=0))
    return provider


def run(corpus: Path, delay: Delay, depth: int, args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=259,
            hidden_size=args.hidden,
            num_layers=2,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=args.hidden // 4,
            intermediate_size=2 * args.hidden,
            attention_backend="torch",
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    task = CausalLMTask(CausalLMTask.Config())
    loader = PrefetchingLoader(
        SlowSource(build_provider(corpus, args.microbatch), delay, args.load_ms / 1e3), depth
    )
    times = []
    try:
        for _ in range(args.steps + 2):
            start = time.perf_counter()
            for mb in loader.next_step():
                out = task.compute_loss(model(**task.forward_inputs(mb)), mb)
                (out.loss_sum / out.weight).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    finally:
        loader.close()
    return statistics.median(times[2:])  # the first steps start the thread and warm the allocator


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load-ms", type=float, default=40.0, help="extra loading time per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(
            "\n".join(f"line {i} " + "lorem ipsum dolor sit amet " * (1 + i % 4) for i in range(5000))
        )
        print(f"extra loading per step: {args.load_ms:.0f} ms (none: only the provider's own work)")
        print(f"{'loading':<8} {'step thread':>12} {'prefetch':>10} {'speed-up':>9}")
        for delay in ("none", "io", "cpu"):
            inline, ahead = run(corpus, delay, 0, args), run(corpus, delay, 2, args)
            print(f"{delay:<8} {inline * 1e3:>10.1f}ms {ahead * 1e3:>8.1f}ms {inline / ahead:>8.2f}x")


if __name__ == "__main__":
    main()
