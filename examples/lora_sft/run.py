"""LoRA fine-tuning of a Hugging Face Qwen3 checkpoint on instruction pairs, with d9d's engine; then the
exports are checked against `transformers` and `peft`.

    python examples/lora_sft/run.py                        # a tiny random Qwen3 as the base, 200 steps
    python examples/lora_sft/run.py --checkpoint DIR       # your Qwen3 (its vocabulary must cover 259 ids)
    python examples/lora_sft/run.py --small                # 20 steps (CI)

Exits non-zero unless the loss dropped, the merged export loaded by `transformers` gives the logits of
d9d's adapted model, and the adapter loaded by `peft.PeftModel.from_pretrained` onto the base
`transformers` model gives them too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import peft
import torch
import torch.distributed as dist
import transformers
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # the config names examples.lora_sft.data:InstructionData

from d9d.core import DistributedContext  # noqa: E402
from d9d.data import ByteTokenizer  # noqa: E402
from d9d.engine.checkpoint import LocalRunReporter  # noqa: E402
from d9d.engine.config import parse_config  # noqa: E402
from d9d.engine.launch import recorded_train  # noqa: E402
from d9d.engine.trainer import Trainer  # noqa: E402
from examples.lora_sft.data import TEMPLATE, read_pairs  # noqa: E402

TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}  # float32; merging reorders the sums of the adapted layers


def make_random_base(path: Path) -> None:
    """A tiny random Qwen3 in Hugging Face format (vocab 259: d9d's byte tokenizer)."""
    config = transformers.Qwen3Config(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        # The head is frozen under LoRA; at the usual 0.02 a random head could not express confident
        # predictions, whatever the adapters do.
        initializer_range=0.3,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


def prompts(path: Path, count: int = 4) -> torch.Tensor:
    """A few prompts of the training set, tokenized the way training saw them, cut to one length."""
    tokenizer = ByteTokenizer()
    rows = [
        torch.tensor([tokenizer.bos_id, *tokenizer.encode(TEMPLATE.format(prompt=p))])
        for p, _ in read_pairs(path)[:count]
    ]
    shortest = min(len(r) for r in rows)
    return torch.stack([r[:shortest] for r in rows])


def greedy_reply(model: transformers.PreTrainedModel, prompt: str, max_new_tokens: int = 40) -> str:
    tokenizer = ByteTokenizer()
    ids = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(TEMPLATE.format(prompt=prompt))]])
    out = model.generate(
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    return tokenizer.decode(out[0, ids.shape[1] :].tolist())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument(
        "--checkpoint", type=Path, help="Hugging Face Qwen3 directory (default: a random one)"
    )
    parser.add_argument("--run-dir", type=Path, help="where the run writes (default: run.dir of the config)")
    parser.add_argument("--small", action="store_true", help="20 steps instead of 200 (CI)")
    args = parser.parse_args()
    if args.checkpoint is not None and not (args.checkpoint / "config.json").is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no config.json, not a Hugging Face checkpoint")
    config_path = args.config.resolve()
    checkpoint = args.checkpoint.resolve() if args.checkpoint else None
    os.chdir(REPO)  # paths in the config are relative to the repository root

    data = yaml.safe_load(config_path.read_text())
    if args.small:
        data["trainer"]["total_steps"] = 20
    if args.run_dir is not None:
        data["run"]["dir"] = str(args.run_dir.resolve())
        data["checkpointing"]["export_hf_dir"] = str(args.run_dir.resolve() / "export")
    run_dir = Path(data["run"]["dir"]).resolve()
    if (run_dir / "checkpoints").is_dir():
        shutil.rmtree(run_dir)  # an earlier run of this example: start afresh, not from its checkpoint
    if checkpoint is None:
        checkpoint = run_dir / "base-qwen3"
        make_random_base(checkpoint)
        print(f"created a tiny random Qwen3 base at {checkpoint}")
    data["model"]["options"]["base"]["options"]["source_checkpoint"] = str(checkpoint)
    config = parse_config(data)  # providers and their options are validated here, before training
    export = config.checkpointing.export_hf_dir
    assert export is not None, "the example checks the exports; set checkpointing.export_hf_dir"

    # One process: a one-rank gloo group on an in-memory store (what `python -m d9d.engine.launch` does).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ctx = DistributedContext.create(config.mesh, backend="gloo")
    trainer = Trainer(config, ctx, LocalRunReporter(config.checkpoint_dir, config.checkpointing.keep_last))
    trainer.setup()
    # Ends with the exports: merged weights and the adapter. Recorded (run.json, run_summary.json), so
    # `d9d list` and `d9d status` show the run's state as for any launcher.
    result = recorded_train(trainer)
    losses = result.losses
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"{result.status} after {result.steps} steps; loss: first 3 steps {first:.4f}, last 3 {last:.4f}")

    ids = prompts(Path(config.data.options["path"]))
    with torch.no_grad():
        adapted = trainer.modules[0].eval()(input_ids=ids)["logits"].float()
        merged = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
        merged_logits = merged(input_ids=ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        base_logits = base(input_ids=ids).logits
        with_adapter = peft.PeftModel.from_pretrained(base, export / "adapter").eval()
        peft_logits = with_adapter(input_ids=ids).logits
        replies = [(p, greedy_reply(merged, p)) for p, _ in read_pairs(Path(config.data.options["path"]))[:3]]
    dist.destroy_process_group()

    def gap(x: torch.Tensor) -> float:
        return float((x - adapted).abs().max())

    print("max |logit difference| to d9d's adapted model:")
    print(f"  transformers on the merged export {gap(merged_logits):.2e}")
    print(f"  peft with the adapter on the base {gap(peft_logits):.2e}")
    print(f"  the base model alone              {gap(base_logits):.2e}")
    print("the merged export answering (greedy):")
    for prompt, reply in replies:
        print(f"  {prompt!r} -> {reply!r}")
    checks = {
        "the loss dropped": last < 0.8 * first,
        "the adapters changed the model": gap(base_logits) > 100 * TOLERANCE["atol"],
        "transformers loads the merged export with equal logits": torch.allclose(
            merged_logits, adapted, **TOLERANCE
        ),
        "peft loads the adapter with equal logits": torch.allclose(peft_logits, adapted, **TOLERANCE),
    }
    for what, ok in checks.items():
        print(f"{'ok' if ok else 'FAILED'}: {what}")
    if not all(checks.values()):
        return 1
    print(
        f"LoRA fine-tune exported and verified: merged weights in {export}, adapter in {export / 'adapter'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
