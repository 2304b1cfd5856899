"""The Hugging Face `datasets` source: save_to_disk directories, parquet and json-lines files, streamed or
not, in the built-in text provider; exact resume after a killed process; packing; background prefetch; and
errors that name the path, split or column."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from d9d.data import ByteTokenizer, HFDatasetConfig, HFDocuments, check_dataset
from d9d.data.prefetch import PrefetchingLoader
from d9d.engine.builtin.text_data import TextDataProvider
from d9d.engine.providers import DataSetup
from tests.engine_fixtures import subprocess_env

datasets = pytest.importorskip("datasets")

ROWS = [{"text": f"document {i}: " + "abcdefgh"[: 1 + (i * 5) % 8] * (1 + i % 3), "n": i} for i in range(23)]
TEXTS = [row["text"] for row in ROWS]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same rows as a save_to_disk Dataset, a DatasetDict with two splits, parquet and json lines."""
    root = tmp_path_factory.mktemp("hf")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(root / "disk"))
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(5))}).save_to_disk(str(root / "dict"))
    ds.to_parquet(str(root / "rows.parquet"))
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (arrow,) = (root / "disk").glob("*.arrow")  # save_to_disk's table: an Arrow stream file
    (root / "rows.arrow").write_bytes(arrow.read_bytes())
    return root


def _source(corpus: Path, name: str, **extra: Any) -> dict[str, Any]:
    return {"source": "hf", "paths": [str(corpus / name)], "cache_dir": str(corpus / "cache"), **extra}


def _provider(
    dataset: dict[str, Any], dp_rank: int = 0, dp_size: int = 1, microbatch: int = 2, **options: Any
) -> TextDataProvider:
    config = TextDataProvider.Config.model_validate({"dataset": dataset, "epochs": 1, **options})
    provider = TextDataProvider(config)
    provider.setup(DataSetup(dp_rank, dp_size, microbatch, 1, microbatch * dp_size, seed=3))
    return provider


def _documents(step: list[dict[str, torch.Tensor]]) -> list[str]:
    """The documents of a step, in order, read back through the labels' document boundaries."""
    tok = ByteTokenizer()
    out = []
    for mb in step:
        for row in mb["input_ids"]:
            doc: list[int] = []
            for i in row.tolist():
                if i == tok.eos_id:
                    out.append(tok.decode(doc))
                    doc = []
                elif i < 256:
                    doc.append(i)
    return out


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> bool:
    """Two steps hold the same microbatches (tensors bitwise, declarations such as padding_side equal)."""
    if len(got) != len(want):
        return False
    for a, b in zip(got, want, strict=True):
        if a.keys() != b.keys():
            return False
        for key, value in b.items():
            same = torch.equal(a[key], value) if isinstance(value, torch.Tensor) else a[key] == value
            if not same:
                return False
    return True


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("name", ["disk", "rows.parquet", "rows.jsonl", "rows.arrow"])
def test_documents_are_the_column_in_row_order(corpus: Path, name: str, streaming: bool) -> None:
    docs = HFDocuments(corpus / name, streaming=streaming, cache_dir=corpus / "cache")
    assert len(docs) == len(ROWS)
    # backwards and repeated access too: a streamed reader restarts when asked for an earlier row
    order = [*range(len(ROWS)), 3, 0, 22, 21]
    assert [docs[i] for i in order] == [TEXTS[i] for i in order]
    split = HFDocuments(corpus / "dict", split="validation", streaming=streaming)
    assert [split[i] for i in range(len(split))] == TEXTS[:5]


@pytest.mark.parametrize("name", ["disk", "rows.parquet"])
def test_provider_reads_every_document_once_across_a_dp_change(corpus: Path, name: str) -> None:
    """Two DP ranks read two steps, then one rank resumes from rank 0's state and reads the rest."""
    ranks = [_provider(_source(corpus, name), r, 2) for r in range(2)]
    seen = [d for _ in range(2) for r in ranks for d in _documents(r.next_step())]
    alone = _provider(_source(corpus, name), 0, 1, microbatch=4)
    alone.load_state_dict(ranks[0].state_dict())
    while step := alone.next_step():
        seen += _documents(step)
    assert sorted(seen) == sorted(TEXTS)


_CHILD = """
import os, signal, sys, json, torch
from d9d.data.prefetch import PrefetchingLoader
from tests.test_data_hf_source import _provider
dataset, out, kill_after = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
loader = PrefetchingLoader(_provider(dataset, bucketing_buffer=None), depth=2)
for step in range(kill_after):
    batches = loader.next_step()
    torch.save({"state": loader.state_dict(), "steps": step + 1}, out + ".tmp")
    os.replace(out + ".tmp", out)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("streaming", [False, True])
def test_resume_after_a_kill_continues_the_sample_order(
    corpus: Path, tmp_path: Path, streaming: bool
) -> None:
    dataset = _source(corpus, "rows.parquet", streaming=streaming)
    straight = _provider(dataset)
    expected = []
    while step := straight.next_step():
        expected.append(step)
    out = tmp_path / "state.pt"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(dataset), str(out), "4"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    saved = torch.load(out)
    assert saved["steps"] == 4
    resumed = _provider(dataset)
    resumed.load_state_dict(saved["state"])
    rest = []
    while step := resumed.next_step():
        rest.append(step)
    assert len(rest) == len(expected) - 4
    assert all(_same(got, want) for got, want in zip(rest, expected[4:], strict=True))


def test_resume_refuses_another_dataset(corpus: Path) -> None:
    provider = _provider(_source(corpus, "rows.parquet"))
    provider.next_step()
    other = _provider(_source(corpus, "disk", column="text"))
    state = provider.state_dict()
    with pytest.raises(ValueError, match="format"):
        other.load_state_dict(state)


def test_prefetched_batches_are_the_same(corpus: Path) -> None:
    """A background loader hands out the same steps in the same order; its state is the consumed position
    (not how far the thread has read), so a provider loading it continues exactly."""
    dataset = _source(corpus, "rows.jsonl")
    direct = _provider(dataset, bucketing_buffer=8)
    loader = PrefetchingLoader(_provider(dataset, bucketing_buffer=8), depth=3)
    for _ in range(3):
        want, got = direct.next_step(), loader.next_step()
        assert _same(got, want)
    state = loader.state_dict()
    assert state == direct.state_dict()
    loader.close()
    again = PrefetchingLoader(_provider(dataset, bucketing_buffer=8), depth=2)
    again.load_state_dict(state)
    while want := direct.next_step():
        got = again.next_step()
        assert _same(got, want)
    assert again.next_step() == [] and again.next_step() == []
    again.close()


class _Broken:
    def __init__(self) -> None:
        self.calls = 0

    def next_step(self) -> list[Any]:
        self.calls += 1
        if self.calls == 2:
            raise OSError("disk gone")
        return [self.calls]

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: Any) -> None:
        self.calls = state["calls"]


def test_prefetch_raises_the_source_error_on_the_step_thread() -> None:
    loader = PrefetchingLoader(_Broken(), depth=2)
    assert loader.next_step() == [1]
    with pytest.raises(OSError, match="disk gone"):
        loader.next_step()


@pytest.mark.parametrize(
    ("changes", "error", "match"),
    [
        ({"paths": ["nowhere"]}, FileNotFoundError, "dataset path nowhere does not exist"),
        (
            {"paths": ["dict"], "split": "test"},
            ValueError,
            r"no split 'test' \(splits: \['train', 'valid",
        ),
        ({"paths": ["dict"]}, ValueError, "choose one with split"),
        (
            {"paths": ["rows.jsonl"], "column": "body"},
            ValueError,
            r"no column 'body' \(columns: \['n', 'tex",
        ),
        ({"paths": ["rows.parquet"], "column": "n"}, ValueError, "column 'n' holds int64, expected strings"),
        ({"paths": ["rows.jsonl"], "column": "n"}, ValueError, r"column 'n' holds int\w*, expected strings"),
        ({"paths": ["disk"], "split": "validation"}, ValueError, "single split"),
        ({"paths": ["rows.jsonl"], "column": "body", "streaming": True}, ValueError, "no column 'body'"),
    ],
)
def test_bad_input_is_named_by_validate_and_at_construction(
    corpus: Path, changes: dict[str, Any], error: type[Exception], match: str
) -> None:
    raw = {**_source(corpus, "disk"), **changes}
    raw["paths"] = [p if p == "nowhere" else str(corpus / p) for p in raw["paths"]]
    config = TextDataProvider.Config.model_validate({"dataset": raw})
    with pytest.raises(error, match=match):
        TextDataProvider(config).validate()
    with pytest.raises(error, match=match):
        _provider(raw)
    assert isinstance(config.dataset, HFDatasetConfig)


def test_validate_checks_the_tokenizer_and_text_files(corpus: Path, tmp_path: Path) -> None:
    hf = HFDatasetConfig.model_validate(
        {**_source(corpus, "disk"), "tokenizer": {"kind": "hf", "path": str(tmp_path)}}
    )
    with pytest.raises(FileNotFoundError, match=r"tokenizer file .*tokenizer\.json does not exist"):
        check_dataset(hf)
    config = TextDataProvider.Config.model_validate({"dataset": {"paths": [str(tmp_path / "x.txt")]}})
    with pytest.raises(FileNotFoundError, match=r"x\.txt does not exist"):
        TextDataProvider(config).validate()


def test_config_refuses_packing_without_a_fitting_max_length_and_shuffling_a_stream(corpus: Path) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"pack_length=32 needs dataset.max_length <= 32 \(is None\)"):
        TextDataProvider.Config.model_validate({"dataset": _source(corpus, "disk"), "pack_length": 32})
    with pytest.raises(ValidationError, match="streamed dataset"):
        TextDataProvider.Config.model_validate(
            {"dataset": _source(corpus, "disk", streaming=True), "bucketing_buffer": 8}
        )


def _tiny_qwen3() -> torch.nn.Module:
    from d9d.models.qwen3 import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=16,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=24,
        attention_backend="torch",
    )
    return Qwen3ForCausalLM(config).double()


def test_packed_steps_give_the_unpacked_loss(corpus: Path) -> None:
    """Packing lays a microbatch's documents end to end with `segment_ids`; through the causal-LM task the
    step's token-mean loss equals the one-document-per-row loss (attention stays inside each document and
    positions restart), while rows have exactly `pack_length` tokens and there are fewer of them."""
    from d9d.engine.builtin.causal_lm import CausalLMTask

    task = CausalLMTask(CausalLMTask.Config())
    model = _tiny_qwen3()
    dataset = _source(corpus, "disk", max_length=40)
    plain = _provider(dataset, microbatch=6)
    packed = _provider(dataset, microbatch=6, pack_length=64)

    def step_loss(step: list[dict[str, Any]]) -> float:
        total, weight = 0.0, 0.0
        with torch.no_grad():
            for mb in step:
                out = task.compute_loss(model(**task.forward_inputs(mb)), mb)
                total, weight = total + float(out.loss_sum), weight + float(out.weight)
        return total / weight

    for _ in range(3):
        a, b = plain.next_step(), packed.next_step()
        assert "segment_ids" in b[0] and "segment_ids" not in a[0]
        assert b[0]["input_ids"].shape[1] == 64 and b[0]["input_ids"].shape[0] < a[0]["input_ids"].shape[0]
        assert _documents(b) == _documents(a)
        assert step_loss(b) == pytest.approx(step_loss(a), rel=1e-9)


def test_hf_tokenizer_reads_the_dataset(corpus: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    words = sorted({w for text in TEXTS for w in text.split()})
    vocab.update({w: i + 4 for i, w in enumerate(words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = {
        "kind": "hf",
        "path": str(tmp_path),
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
    }
    provider = _provider(_source(corpus, "rows.parquet", tokenizer=tokenizer), microbatch=3)
    row = provider.next_step()[0]["input_ids"][1]
    assert row.tolist()[: len(TEXTS[1].split()) + 2] == [1, *(vocab[w] for w in TEXTS[1].split()), 2]
    no_pad = {**tokenizer, "pad_token": None}
    config = TextDataProvider.Config.model_validate({"dataset": _source(corpus, "disk", tokenizer=no_pad)})
    with pytest.raises(ValueError, match="tokenizer has no padding token"):
        TextDataProvider(config).validate()


def _swapped_rows() -> list[dict[str, Any]]:
    """Other rows of the same count and text lengths: saved, their Arrow files have the same sizes."""
    return [{**row, "text": str(row["text"]).replace("a", "z")} for row in ROWS]


@pytest.mark.parametrize(("name", "split"), [("disk", None), ("dict", "train")])
def test_resume_refuses_another_saved_dataset_of_the_same_size(
    corpus: Path, tmp_path: Path, name: str, split: str | None
) -> None:
    other = datasets.Dataset.from_list(_swapped_rows())
    if split is None:
        other.save_to_disk(str(tmp_path / name))
    else:
        datasets.DatasetDict({"train": other, "validation": other.select(range(5))}).save_to_disk(
            str(tmp_path / name)
        )
    ours, theirs = corpus / name, tmp_path / name
    ours_sizes, theirs_sizes = (
        {p.relative_to(root): p.stat().st_size for p in root.rglob("*.arrow")} for root in (ours, theirs)
    )
    assert ours_sizes == theirs_sizes  # same file names and sizes: only the content differs
    provider = _provider(_source(corpus, name, split=split))
    provider.next_step()
    state = provider.state_dict()
    swapped = _provider({**_source(corpus, name, split=split), "paths": [str(theirs)]})
    with pytest.raises(ValueError, match=f"hf documents of dataset {theirs}.*saved"):
        swapped.load_state_dict(state)
    # The same directory resumes, and continues where the first provider is.
    again = _provider(_source(corpus, name, split=split))
    again.load_state_dict(state)
    assert _same(again.next_step(), provider.next_step())


def test_state_from_before_saved_directories_were_fingerprinted_still_resumes(corpus: Path) -> None:
    provider = _provider(_source(corpus, "disk"))
    provider.next_step()
    state = provider.state_dict()
    documents = state["dataset"]["documents"]
    assert documents["saved"]["fingerprint"]  # what datasets recorded in state.json
    del documents["saved"]
    again = _provider(_source(corpus, "disk"))
    again.load_state_dict(state)
    assert _same(again.next_step(), provider.next_step())
