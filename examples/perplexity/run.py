"""Perplexity of a Hugging Face-format checkpoint on a text file, with d9d's inference loop, checked
against `transformers` on the very same tokens.

    python examples/perplexity/run.py                         # a tiny random Qwen3 on sample.txt
    python examples/perplexity/run.py --checkpoint DIR --text FILE
    torchrun --nproc-per-node 2 examples/perplexity/run.py    # data parallel: each rank scores its share

Exits non-zero unless d9d's perplexity equals the transformers reference (relative tolerance 1e-5).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
import yaml

from d9d.core import DistributedContext
from d9d.core.mesh_params import DeviceMeshParameters
from d9d.data import TextDatasetConfig, build_text_dataset
from d9d.engine.inference import InferenceConfig, run_inference

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def make_random_checkpoint(path: Path) -> None:
    """A tiny random Qwen3 in Hugging Face format; vocab 259 fits d9d's byte tokenizer."""
    config = transformers.Qwen3Config(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        initializer_range=0.1,  # logits far from uniform: a token misalignment could not hide
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


@torch.no_grad()
def transformers_perplexity(checkpoint: Path, dataset: TextDatasetConfig) -> tuple[float, int]:
    """The reference: every document on its own (no padding), each token scored on the next one within
    its document; the last token of a document has no target."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    documents = build_text_dataset(dataset)
    nll, tokens = 0.0, 0
    for i in range(len(documents)):
        ids = documents[i]["input_ids"]
        logits = model(input_ids=ids[None, :-1]).logits[0]
        nll += float(torch.nn.functional.cross_entropy(logits.double(), ids[1:], reduction="sum"))
        tokens += len(ids) - 1
    return math.exp(nll / tokens), tokens


def join_process_group() -> None:
    """torchrun's environment is read by DistributedContext.create; a plain `python` run gets a one-rank
    gloo group on an in-memory store, so meshes and DTensors exist exactly as on a cluster."""
    if not dist.is_initialized() and "RANK" not in os.environ:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument(
        "--checkpoint", type=Path, help="Hugging Face Qwen3 directory (default: a random one)"
    )
    parser.add_argument("--text", type=Path, help="text file, one document per line (default: sample.txt)")
    parser.add_argument("--run-dir", type=Path, help="where the run writes (default: run.dir of the config)")
    parser.add_argument("--small", action="store_true", help="truncate documents to 64 tokens (CI)")
    args = parser.parse_args()
    if args.text is not None and not args.text.is_file():
        parser.error(f"--text {args.text}: no such file")
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no config.json, not a Hugging Face checkpoint")
    checkpoint = args.checkpoint.resolve() if args.checkpoint else None
    text = args.text.resolve() if args.text else None
    run_dir = args.run_dir.resolve() if args.run_dir else None
    os.chdir(REPO)  # paths in the config are relative to the repository root

    raw: dict[str, Any] = yaml.safe_load(args.config.read_text())
    dataset = raw["data"]["options"]["dataset"]
    if text is not None:
        dataset["paths"] = [str(text)]
    if args.small:
        dataset["max_length"] = 64
    if run_dir is not None:
        raw["run"]["dir"] = str(run_dir)
    if checkpoint is None:
        checkpoint = (Path(raw["run"]["dir"]) / "random-qwen3").resolve()
    raw["model"]["options"]["source_checkpoint"] = str(checkpoint)

    join_process_group()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    raw["mesh"] = {"data_parallel_replicate": world}
    ctx = DistributedContext.create(DeviceMeshParameters.model_validate(raw["mesh"]), backend="gloo")
    if args.checkpoint is None and ctx.is_main_process:
        make_random_checkpoint(checkpoint)
        print(f"created a tiny random Qwen3 at {checkpoint}")
    dist.barrier()
    config = InferenceConfig.model_validate(raw)  # after the checkpoint exists: the options check it

    result = run_inference(config, ctx)
    ok = True
    if ctx.is_main_process:
        print(f"d9d:          perplexity {result['perplexity']:.6f} over {int(result['tokens'])} tokens")
        reference, tokens = transformers_perplexity(checkpoint, TextDatasetConfig.model_validate(dataset))
        print(f"transformers: perplexity {reference:.6f} over {tokens} tokens")
        ok = int(result["tokens"]) == tokens and math.isclose(result["perplexity"], reference, rel_tol=1e-5)
        print("perplexity matches transformers" if ok else "MISMATCH between d9d and transformers")
    flag = torch.tensor([float(ok)])
    dist.broadcast(flag, src=0)
    dist.destroy_process_group()
    return 0 if bool(flag.item()) else 1


if __name__ == "__main__":
    sys.exit(main())
