"""Train a custom model (model.py) with d9d's engine on Ray rank actors, follow it, check the outcome.

    python examples/bring_your_own_model/run.py            # 60 steps on 2 CPU rank actors, local Ray
    python examples/bring_your_own_model/run.py --small    # 20 steps (CI)

Exits non-zero unless the run finished, the loss dropped, and the exported weights load into a fresh
`TinyGPT` whose loss on the training text is below the first step's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The config names the provider by import path (examples.bring_your_own_model.model:TinyGPTProvider):
# the driver imports it to validate the options, the rank actors (other processes) to build the model.
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

from d9d.cluster import TrainingJob, disconnect  # noqa: E402
from d9d.data import CausalLMCollator, TextDatasetConfig, build_text_dataset  # noqa: E402
from examples.bring_your_own_model.model import IGNORE_INDEX, load_exported  # noqa: E402


def exported_loss(export: Path, dataset: TextDatasetConfig) -> float:
    """Mean next-token loss of the exported model over the whole training text, outside d9d's engine."""
    model = load_exported(export)
    documents = build_text_dataset(dataset)
    batch = CausalLMCollator(pad_id=documents.tokenizer.pad_id)([documents[i] for i in range(len(documents))])
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"])
    labels = batch["labels"]
    return float(
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", type=Path, default=HERE / "config.yaml")
    parser.add_argument("--run-dir", type=Path, help="where the run writes (default: run.dir of the config)")
    parser.add_argument("--small", action="store_true", help="20 steps instead of 60 (CI)")
    parser.add_argument("--resume", action="store_true", help="continue from the run dir's last checkpoint")
    args = parser.parse_args()
    config = args.config.resolve()
    run_dir = args.run_dir.resolve() if args.run_dir else None
    os.chdir(REPO)  # paths in the config are relative to the repository root

    job_file = yaml.safe_load(config.read_text())
    if args.small:
        job_file["trainer"]["total_steps"] = 20
    if run_dir is not None:
        job_file["run"]["dir"] = str(run_dir)
        job_file["checkpointing"]["export_hf_dir"] = str(run_dir / "export")
    # Rank actors may run in another directory: give them an absolute export path.
    export = Path(job_file["checkpointing"]["export_hf_dir"]).resolve()
    job_file["checkpointing"]["export_hf_dir"] = str(export)
    # Everything (schema, provider options, mesh vs batch) is validated here, before Ray starts.
    job = TrainingJob(job_file)
    earlier = job.spec.run_dir
    if not args.resume and ((earlier / "checkpoints").is_dir() or (earlier / "run_summary.json").is_file()):
        print(f"starting afresh: removing the earlier run in {earlier} (--resume continues it instead)")
        shutil.rmtree(earlier)

    print(f"starting {job.run_name}: {job.spec.initial_workers} rank actors, run dir {job.spec.run_dir}")
    job.start()  # a local Ray instance unless RAY_ADDRESS is set
    try:
        accuracy: dict[int, float] = {}
        for point in job.metrics():  # ends when the run has ended and every point was delivered
            if point.kind != "train":
                continue  # per-rank health points (step time, memory) and the cluster's own
            if "task/accuracy" in point.values:  # task metrics arrive a little after the step's loss
                accuracy[point.step] = point.values["task/accuracy"]
                if point.step % 5 == 0:
                    print(f"step {point.step:3d}  next-byte accuracy {accuracy[point.step]:.3f}")
        summary = job.result()
    finally:
        disconnect()

    print(f"run {summary.run_name} {summary.status}: {summary.steps} steps, final loss {summary.final_loss}")
    if summary.status != "finished":
        print(f"FAILED: the run ended {summary.status}: {summary.error}")
        return 1
    losses = [summary.losses[s] for s in sorted(summary.losses)]
    if len(losses) < 6:
        print(f"FAILED: only {len(losses)} steps trained in this run; too few to judge the loss")
        return 1
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    reloaded = exported_loss(export, TextDatasetConfig.model_validate(job_file["data"]["options"]["dataset"]))
    print(
        f"loss: first 3 steps {first:.4f}, last 3 steps {last:.4f}; exported model on the text {reloaded:.4f}"
    )
    if not last < 0.8 * first:
        print("FAILED: the loss did not drop")
        return 1
    steps = sorted(accuracy)
    first_acc, last_acc = accuracy[steps[0]], accuracy[steps[-1]]
    print(f"next-byte accuracy: step {steps[0]} {first_acc:.3f}, step {steps[-1]} {last_acc:.3f}")
    if not last_acc > first_acc:
        print("FAILED: the accuracy did not rise")
        return 1
    if not reloaded < losses[0]:
        print("FAILED: the exported model is no better than the first step")
        return 1
    print("custom model trained on 2 rank actors: loss dropped, export reloads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
