"""The built-in text data provider: collated microbatches and a position that survives a DP change."""

from __future__ import annotations

from pathlib import Path

import torch

from d9d.data import ByteTokenizer
from d9d.engine.builtin.text_data import TextDataProvider
from d9d.engine.providers import DataSetup


def _provider(corpus: Path, dp_rank: int, dp_size: int, accumulation: int) -> TextDataProvider:
    provider = TextDataProvider(
        TextDataProvider.Config.model_validate({"dataset": {"paths": [str(corpus)]}, "epochs": 1})
    )
    provider.setup(DataSetup(dp_rank, dp_size, 2, accumulation, 2 * accumulation * dp_size, seed=0))
    return provider


def _docs(step: list[dict[str, torch.Tensor]]) -> list[str]:
    tok = ByteTokenizer()
    out = []
    for mb in step:
        for row in mb["input_ids"]:
            ids = [int(i) for i in row if int(i) < 256]
            out.append(tok.decode(ids))
    return out


def test_microbatches_and_elastic_resume(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    lines = [f"document number {i} " + "x" * (i % 7) for i in range(40)]
    corpus.write_text("\n".join(lines))
    # dp2, accumulation 2: each step is 8 documents, 2 microbatches of 2 per rank.
    ranks = [_provider(corpus, r, 2, 2) for r in range(2)]
    first = [ranks[r].next_step() for r in range(2)]
    mb = first[0][0]
    assert len(first[0]) == 2
    assert mb["input_ids"].shape == mb["labels"].shape == mb["position_ids"].shape
    assert mb["input_ids"].shape[1] % 8 == 0
    # labels are the next token within the document, -100 after its end
    row, labels = mb["input_ids"][0], mb["labels"][0]
    n = int((labels != -100).sum())
    assert torch.equal(labels[:n], row[1 : n + 1])
    seen = [d for r in range(2) for d in _docs(first[r])]
    second = [ranks[r].next_step() for r in range(2)]
    seen += [d for r in range(2) for d in _docs(second[r])]
    # Elastic: shrink to one rank (accumulation 4 keeps the global batch), resuming from rank 0's state.
    state = ranks[0].state_dict()
    alone = _provider(corpus, 0, 1, 4)
    alone.load_state_dict(state)
    while step := alone.next_step():
        seen += _docs(step)
    assert sorted(seen) == sorted(lines), "a document was skipped or repeated across the DP change"


def test_padded_microbatches_declare_right_padding_to_the_model(tmp_path: Path) -> None:
    """A padded microbatch carries its mask and the collator's side; the causal-LM task hands both to the
    model, which then keeps the plain causal kernel; an unpadded one carries neither."""
    from d9d.engine.builtin.causal_lm import CausalLMTask

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["short", "a much longer document line", "x" * 8, "y" * 8]))
    task = CausalLMTask(CausalLMTask.Config())
    seen_padded = False
    for mb in _provider(corpus, 0, 1, 1).next_step() + _provider(corpus, 0, 1, 1).next_step():
        inputs = task.forward_inputs(mb)
        if "attention_mask" in mb:
            seen_padded = True
            assert inputs["padding_side"] == "right"
            mask = inputs["attention_mask"]
            # right padding: once a row's mask drops to 0 it never returns to 1
            assert bool((mask[:, 1:] <= mask[:, :-1]).all())
        else:
            assert "padding_side" not in inputs
    assert seen_padded, "the corpus was meant to give a padded microbatch"
