"""Tokenizers and text/jsonl readers against independent references (string ops, json, transformers)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter, ValidationError

from d9d.data.bucketing import BufferSortedDataset
from d9d.data.sharding import ShardedDataset
from d9d.data.sources import (
    FileDocuments,
    JsonlField,
    TextDatasetConfig,
    TextLines,
    TextParagraphs,
    TokenizedDataset,
    build_text_dataset,
)
from d9d.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig, build_tokenizer

TEXTS = [
    "",
    "hello",
    "naïve café",
    "日本語のテキスト",
    "emoji 🧪🚀 and\ttabs\nnewlines",
    "a\u0301 combining",
    "<eos> literal",
]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trips(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text


def test_byte_tokenizer_vocabulary() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 259
    assert {tok.bos_id, tok.eos_id, tok.pad_id} == {256, 257, 258}
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # a cut multi-byte character does not raise
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("hf_tok")
    tok = RustTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50 + TEXTS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}, "pad_token": None})
    )
    return out


def test_hf_tokenizer_matches_transformers(hf_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    ours = HFTokenizer(hf_dir)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"))
    assert isinstance(ours, Tokenizer)
    assert ours.vocab_size == len(ref)
    for text in [*TEXTS, "the quick brown fox"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text
    assert ours.bos_id == ref.convert_tokens_to_ids("<s>")
    assert ours.eos_id == ref.convert_tokens_to_ids("</s>")
    assert ours.pad_id is None


def test_hf_tokenizer_ignores_truncation_and_padding_saved_in_the_file(hf_dir: Path, tmp_path: Path) -> None:
    """A tokenizer.json saved with truncation or padding on (as many exported ones are) must not cut a
    document short or put pad ids inside it, where they would train as real tokens: each document is
    encoded whole, as by the same tokenizer without those settings (regression: both were applied)."""
    from tokenizers import Tokenizer as RustTokenizer

    text = " ".join(TEXTS)
    plain = HFTokenizer(hf_dir).encode(text)
    rust = RustTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    rust.enable_truncation(max_length=4)
    rust.save(str(tmp_path / "truncating.json"))
    rust.no_truncation()
    rust.enable_padding(pad_id=3, pad_token="<pad>", length=len(plain) + 16)
    rust.save(str(tmp_path / "padding.json"))
    assert len(plain) > 4
    for name in ("truncating.json", "padding.json"):
        assert HFTokenizer(tmp_path / name).encode(text) == plain, name


def test_hf_tokenizer_explicit_specials_and_errors(hf_dir: Path) -> None:
    tok = HFTokenizer(hf_dir / "tokenizer.json", pad_token="<pad>", eos_token="<s>")
    assert tok.pad_id == tok._tok.token_to_id("<pad>") and tok.eos_id == tok._tok.token_to_id("<s>")
    with pytest.raises(ValueError, match=r"bos_token='<bos>'"):
        HFTokenizer(hf_dir, bos_token="<bos>")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        HFTokenizer(hf_dir / "nowhere.json")


def test_tokenizer_config_union(hf_dir: Path) -> None:
    adapter = TypeAdapter(TokenizerConfig)
    assert isinstance(build_tokenizer(adapter.validate_python({"kind": "byte"})), ByteTokenizer)
    hf = build_tokenizer(adapter.validate_python({"kind": "hf", "path": str(hf_dir)}))
    assert isinstance(hf, HFTokenizer) and hf.bos_id is not None
    with pytest.raises(ValidationError, match="kind"):
        adapter.validate_python({"kind": "sentencepiece"})


RAW_TEXT = "first line\r\nsecond  line\n\n   \nthird\nfourth para line 1\n\n\nlast ü line"


def test_text_lines_and_paragraphs_match_string_splitting(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_bytes(RAW_TEXT.encode())
    lines = FileDocuments(path, TextLines())
    assert [lines[i] for i in range(len(lines))] == [
        ln for ln in RAW_TEXT.replace("\r\n", "\n").split("\n") if ln.strip()
    ]
    paras = FileDocuments(path, TextParagraphs())
    normalized = RAW_TEXT.replace("\r\n", "\n")
    reference = [block.strip("\n") for block in re.split(r"\n(?:[ \t]*\n)+", normalized) if block.strip()]
    got = [paras[i].replace("\r\n", "\n") for i in range(len(paras))]
    assert got == reference == ["first line\nsecond  line", "third\nfourth para line 1", "last ü line"]


def test_multiple_files_and_pickling(tmp_path: Path) -> None:
    import pickle

    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("a1\na2\n")
    b.write_text("b1\n")
    docs = FileDocuments([a, b], TextLines())
    assert [docs[i] for i in range(3)] == ["a1", "a2", "b1"]
    copy = pickle.loads(pickle.dumps(docs))
    assert [copy[i] for i in range(3)] == ["a1", "a2", "b1"]
    with pytest.raises(IndexError):
        docs[3]


def test_jsonl_field_and_errors(tmp_path: Path) -> None:
    rows = [{"text": "alpha", "id": 1}, {"text": "βeta\nwith newline", "id": 2}, {"body": "x", "text": "γ"}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    docs = FileDocuments(path, JsonlField("text"))
    assert [docs[i] for i in range(len(docs))] == [r["text"] for r in rows]
    with pytest.raises(ValueError, match=r"d.jsonl line 1: no field 'body'"):
        FileDocuments(path, JsonlField("body"))
    with pytest.raises(ValueError, match=r"line 1: field 'id' is int"):
        FileDocuments(path, JsonlField("id"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: not valid JSON"):
        FileDocuments(bad, JsonlField())


def test_tokenized_dataset_adds_specials_and_truncates(tmp_path: Path) -> None:
    path = tmp_path / "c.txt"
    path.write_text("hello world\nhi\n")
    tok = ByteTokenizer()
    ds = TokenizedDataset(FileDocuments(path, TextLines()), tok, max_length=6)
    assert ds[0]["input_ids"].tolist() == [tok.bos_id, *b"hell", tok.eos_id]
    assert ds[1]["input_ids"].tolist() == [tok.bos_id, *b"hi", tok.eos_id]
    plain = TokenizedDataset(FileDocuments(path, TextLines()), tok, add_bos=False, add_eos=False)
    assert tok.decode(plain[0]["input_ids"].tolist()) == "hello world"
    with pytest.raises(ValueError, match="max_length=2"):
        TokenizedDataset(FileDocuments(path, TextLines()), tok, max_length=2)


def test_build_text_dataset_formats(tmp_path: Path, hf_dir: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"content": "from jsonl"}\n')
    (tmp_path / "y.txt").write_text("p1 l1\np1 l2\n\np2\n")
    ds = build_text_dataset(TextDatasetConfig(paths=[tmp_path / "x.jsonl"], field="content", add_bos=False))
    assert ByteTokenizer().decode(ds[0]["input_ids"].tolist()) == "from jsonl"
    paras = build_text_dataset(
        TextDatasetConfig(
            paths=[tmp_path / "y.txt"], split="paragraph", tokenizer={"kind": "hf", "path": hf_dir}
        )
    )
    assert len(paras) == 2 and paras.tokenizer.decode(paras[0]["input_ids"].tolist()) == "p1 l1\np1 l2"
    with pytest.raises(ValueError, match="mix jsonl and text"):
        build_text_dataset(TextDatasetConfig(paths=[tmp_path / "x.jsonl", tmp_path / "y.txt"]))
    with pytest.raises(ValidationError, match="paths"):
        TextDatasetConfig(paths=[])
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        build_text_dataset(TextDatasetConfig(paths=[tmp_path / "missing.txt"]))


def _pipeline(path: Path, shard: int) -> ShardedDataset:
    ds = build_text_dataset(TextDatasetConfig(paths=[path]))
    bucketed = BufferSortedDataset(ds, buffer_size=8, pack_size=2, seed=4)
    return ShardedDataset(bucketed, num_shards=2, shard_index=shard, uneven="pad", epochs=2)


def test_full_pipeline_exact_resume(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " + "x" * (i % 7)}) + "\n" for i in range(21)))
    for k in (0, 5, 11, 15):
        first = _pipeline(path, 1)
        it = iter(first)
        for _ in range(k):
            next(it)
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)
        expected = [s["input_ids"].tolist() for s in first]
        resumed = _pipeline(path, 1)
        buf.seek(0)
        resumed.load_state_dict(torch.load(buf, weights_only=True))
        assert [s["input_ids"].tolist() for s in resumed] == expected


def test_resume_refused_when_the_file_changed(tmp_path: Path) -> None:
    path = tmp_path / "docs.txt"
    path.write_text("one\ntwo\nthree\n")
    state = _pipeline(path, 0).state_dict()
    path.write_text("one\ntwo\nthree!\n")
    with pytest.raises(ValueError, match="files"):
        _pipeline(path, 0).load_state_dict(state)
