"""Streaming reader/writer: bitwise round trips against the `safetensors` library, layouts, errors."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import d9d.state.io.reader as reader_module
from d9d.state import (
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointFormatError,
    Concat,
    Identity,
    Parallel,
    Prefixed,
    Rename,
    Stack,
    StateMappingError,
    StateReader,
    StateWriter,
    Transpose,
    load_model_state,
    read_model_state,
    resolve_checkpoint,
    save_model_state,
)

E, H, INTER, Q, KV = 4, 8, 6, 8, 4  # experts, hidden, expert intermediate, q rows, kv rows


def hf_state(layers: int = 2, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(10, H, generator=g).to(dtype)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for e in range(E):
            state[f"{p}mlp.experts.{e}.up_proj.weight"] = torch.randn(INTER, H, generator=g).to(dtype)
        state[f"{p}self_attn.q_proj.weight"] = torch.randn(Q, H, generator=g).to(dtype)
        state[f"{p}self_attn.k_proj.weight"] = torch.randn(KV, H, generator=g).to(dtype)
        state[f"{p}self_attn.v_proj.weight"] = torch.randn(KV, H, generator=g).to(dtype)
        state[f"{p}input_layernorm.weight"] = torch.randn(H, generator=g).to(dtype)
    return state


def hf_to_d9d(layers: int = 2) -> Parallel:
    """The kind of mapper the models package builds: rename + per-expert stack + qkv merge, per layer."""
    layer = Parallel(
        [
            Stack([f"mlp.experts.{e}.up_proj.weight" for e in range(E)], "moe.up", dim=0),
            Concat(
                [f"self_attn.{x}_proj.weight" for x in "qkv"], "attn.qkv.weight", dim=0, sizes=[Q, KV, KV]
            ),
            Rename({"input_layernorm.weight": "norm.weight"}),
        ]
    )
    # model.layers.{i}.<hf name> -> layers.{i}.<d9d name>
    scoped = [
        Prefixed(f"model.layers.{i}.", Prefixed(f"layers.{i}.", layer, on="output"), on="input")
        for i in range(layers)
    ]
    return Parallel([Rename({"model.embed_tokens.weight": "embed.weight"}), *scoped])


def expected_d9d(hf: dict[str, torch.Tensor], layers: int = 2) -> dict[str, torch.Tensor]:
    """The same conversion written directly with torch ops: the independent reference."""
    out = {"embed.weight": hf["model.embed_tokens.weight"]}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[f"layers.{i}.moe.up"] = torch.stack([hf[f"{p}mlp.experts.{e}.up_proj.weight"] for e in range(E)])
        out[f"layers.{i}.attn.qkv.weight"] = torch.cat([hf[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"])
        out[f"layers.{i}.norm.weight"] = hf[f"{p}input_layernorm.weight"]
    return out


def write_hf_sharded(path: Path, state: dict[str, torch.Tensor], files: int) -> None:
    """An HF-style sharded checkpoint written with the safetensors library itself."""
    path.mkdir(parents=True)
    keys = sorted(state)
    weight_map = {}
    for f in range(files):
        name = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        part = {k: state[k] for k in keys[f::files]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (path / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    """Read a checkpoint directory with the safetensors library (independent of our reader)."""
    if (path / SINGLE_NAME).exists():
        assert not (path / INDEX_NAME).exists()
        return load_file(str(path / SINGLE_NAME))
    weight_map = json.loads((path / INDEX_NAME).read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        part = load_file(str(path / name))
        assert {k for k, v in weight_map.items() if v == name} == part.keys()
        out.update(part)
    return out


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("files", [1, 3])
def test_read_hf_checkpoint_through_mapper_bitwise(tmp_path, files):
    hf = hf_state()
    if files == 1:
        tmp_path.joinpath("ckpt").mkdir()
        save_file(hf, str(tmp_path / "ckpt" / SINGLE_NAME))
    else:
        write_hf_sharded(tmp_path / "ckpt", hf, files)
    got = dict(read_model_state(tmp_path / "ckpt", hf_to_d9d()))
    assert_bitwise(got, expected_d9d(hf))


@pytest.mark.parametrize("max_shard_bytes", [10**9, 700])
def test_write_inverse_mapper_roundtrip_bitwise(tmp_path, max_shard_bytes):
    hf = hf_state()
    d9d_state = expected_d9d(hf)
    dest = save_model_state(
        tmp_path / "out", d9d_state, hf_to_d9d().inverse(), max_shard_bytes=max_shard_bytes
    )
    files = sorted(p.name for p in dest.iterdir())
    if max_shard_bytes > 10**6:
        assert files == [SINGLE_NAME]
    else:
        index = json.loads((dest / INDEX_NAME).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and files == sorted([*shards, INDEX_NAME])
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in hf.values())
        for name in shards:  # the size cap holds unless one tensor alone is larger
            part = load_file(str(dest / name))
            size = sum(t.numel() * t.element_size() for t in part.values())
            assert size <= max_shard_bytes or len(part) == 1
    assert_bitwise(load_dir(dest), hf)
    # and back again through our reader
    assert_bitwise(dict(read_model_state(dest, hf_to_d9d())), d9d_state)
    assert not list(tmp_path.glob(".out.*")), "temp dir left behind"


def test_all_dtypes_and_odd_shapes_roundtrip(tmp_path):
    state = {
        "f32": torch.randn(3, 5),
        "f64": torch.randn(2).double(),
        "f16": torch.randn(4, 1).half(),
        "i64": torch.arange(7),
        "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "noncontig": torch.randn(4, 6)[:, ::2],
    }
    dest = save_model_state(tmp_path / "c", state)
    assert_bitwise(load_dir(dest), {k: v.contiguous() for k, v in state.items()})
    assert_bitwise(
        dict(read_model_state(dest, Identity(state))), {k: v.contiguous() for k, v in state.items()}
    )


def test_misaligned_tensors_are_read_by_copy(tmp_path):
    """Another writer may place an f32 at an odd offset; the reader must not map it misaligned."""
    data = (
        torch.tensor([1, 2, 3], dtype=torch.uint8).numpy().tobytes()
        + torch.tensor([1.5, -2.0]).numpy().tobytes()
    )
    header = {"a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}
    header["b"] = {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-aligned, so "b" sits at an offset of 3 mod 8
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    got = dict(read_model_state(tmp_path / "m.safetensors", Identity(["a", "b"])))
    assert_bitwise(got, load_file(str(tmp_path / "m.safetensors")))
    assert_bitwise(got, {"a": torch.tensor([1, 2, 3], dtype=torch.uint8), "b": torch.tensor([1.5, -2.0])})


def test_groups_fire_as_soon_as_their_file_is_read(tmp_path, monkeypatch):
    """Two files; the layer-0 group must be yielded before any layer-1 key is read."""
    hf = hf_state()
    (tmp_path / "c").mkdir()
    layer0 = {k: v for k, v in hf.items() if ".layers.1." not in k}
    layer1 = {k: v for k, v in hf.items() if ".layers.1." in k}
    save_file(layer0, str(tmp_path / "c" / "a.safetensors"))
    save_file(layer1, str(tmp_path / "c" / "b.safetensors"))
    weight_map = {**dict.fromkeys(layer0, "a.safetensors"), **dict.fromkeys(layer1, "b.safetensors")}
    (tmp_path / "c" / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    read: list[str] = []
    real = reader_module.read_tensor

    def spy(f, path, key, entry):
        read.append(key)
        return real(f, path, key, entry)

    monkeypatch.setattr(reader_module, "read_tensor", spy)
    for key, _ in read_model_state(tmp_path / "c", hf_to_d9d()):
        if key.startswith("layers.0."):
            assert not any(".layers.1." in k for k in read)
    assert sorted(read) == sorted(hf)


def test_reader_only_reads_what_the_mapper_needs(tmp_path, monkeypatch):
    hf = hf_state()
    write_hf_sharded(tmp_path / "c", hf, 3)
    read: list[str] = []
    real = reader_module.read_tensor
    monkeypatch.setattr(
        reader_module, "read_tensor", lambda f, p, k, e: (read.append(k), real(f, p, k, e))[1]
    )
    got = dict(read_model_state(tmp_path / "c", Transpose(["model.layers.1.self_attn.k_proj.weight"])))
    assert read == ["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(
        got["model.layers.1.self_attn.k_proj.weight"], hf["model.layers.1.self_attn.k_proj.weight"].T
    )


def test_load_model_state_into_module_matches_load_state_dict(tmp_path):
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    save_file(ref.state_dict(), str(tmp_path / "m.safetensors"))
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    load_model_state(tmp_path / "m.safetensors", module)
    assert_bitwise(module.state_dict(), ref.state_dict())
    # through a mapper that renames, and only for the keys this module has (others are not read)
    renamed = {f"net.{k}": v for k, v in ref.state_dict().items()}
    save_file({**renamed, "other.w": torch.ones(2)}, str(tmp_path / "r.safetensors"))
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    mapper = Rename({**{k: k.removeprefix("net.") for k in renamed}, "other.w": "elsewhere"})
    load_model_state(tmp_path / "r.safetensors", fresh, mapper)
    assert_bitwise(fresh.state_dict(), ref.state_dict())


def test_load_errors_name_key_and_file(tmp_path):
    module = torch.nn.Linear(4, 3)
    save_file({"weight": torch.zeros(3, 5), "bias": torch.zeros(3)}, str(tmp_path / "shape.safetensors"))
    with pytest.raises(CheckpointFormatError, match=r"'weight' from shape.safetensors .*\(3, 5\).*\(3, 4\)"):
        load_model_state(tmp_path / "shape.safetensors", module)
    save_file({"weight": torch.zeros(3, 4).half(), "bias": torch.zeros(3)}, str(tmp_path / "dt.safetensors"))
    with pytest.raises(
        CheckpointFormatError, match=r"'weight' from dt.safetensors.*float16.*float32.*allow_cast"
    ):
        load_model_state(tmp_path / "dt.safetensors", module)
    load_model_state(tmp_path / "dt.safetensors", module, allow_cast=True)
    assert module.weight.dtype == torch.float32 and not module.weight.any()
    with pytest.raises(CheckpointFormatError, match=r"no value for 1 module key\(s\), e.g. \['bias'\]"):
        load_model_state(tmp_path / "dt.safetensors", module, Rename({"weight": "weight"}))
    with torch.device("meta"):
        meta = torch.nn.Linear(4, 3)
    with pytest.raises(CheckpointFormatError, match="'weight' is on the meta device"):
        load_model_state(tmp_path / "dt.safetensors", meta)
    save_file({"a": torch.zeros(3), "b": torch.zeros(2)}, str(tmp_path / "s.safetensors"))
    with pytest.raises(
        StateMappingError, match=r"Stack.*'b' has shape \(2,\).*\[inputs read from s.safetensors"
    ):
        list(read_model_state(tmp_path / "s.safetensors", Stack(["a", "b"], "ab")))


def _valid_file(path: Path) -> None:
    save_file({"w": torch.arange(16, dtype=torch.float32), "v": torch.ones(2)}, str(path))


def test_corrupt_and_truncated_files(tmp_path):
    path = tmp_path / "model.safetensors"
    _valid_file(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])

    path.write_bytes(raw[: len(raw) - 10])
    with pytest.raises(CheckpointFormatError, match=r"model.safetensors: truncated, '\w' ends at byte"):
        StateReader(path, Identity(["w"]))
    path.write_bytes(raw[:5])
    with pytest.raises(CheckpointFormatError, match=r"model.safetensors: truncated, 5 bytes"):
        StateReader(tmp_path, Identity(["w"]))
    path.write_bytes(raw[:8] + b"{not json" + raw[17:])
    with pytest.raises(CheckpointFormatError, match=r"model.safetensors: corrupt header, not valid JSON"):
        StateReader(path, Identity(["w"]))
    path.write_bytes(struct.pack("<Q", 10**12) + raw[8:])
    with pytest.raises(CheckpointFormatError, match="corrupt header, it claims 1000000000000 bytes"):
        StateReader(path, Identity(["w"]))
    header = json.loads(raw[8 : 8 + n])
    header["w"]["dtype"] = "Q7"
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    with pytest.raises(CheckpointFormatError, match="'w' has unsupported dtype 'Q7'"):
        StateReader(path, Identity(["w"]))
    header["w"]["dtype"], header["w"]["shape"] = "F32", [17]
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])
    with pytest.raises(CheckpointFormatError, match=r"'w' spans bytes \[\d+, \d+\) but shape \(17,\)"):
        StateReader(path, Identity(["w"]))


def test_index_errors(tmp_path):
    hf = hf_state(layers=1)
    write_hf_sharded(tmp_path / "c", hf, 2)
    index = tmp_path / "c" / INDEX_NAME
    body = json.loads(index.read_text())
    with pytest.raises(
        CheckpointFormatError, match=r"model.safetensors.index.json: no entry for 1 key.*'nope'"
    ):
        StateReader(tmp_path / "c", Identity(["nope", "model.embed_tokens.weight"]))
    key = "model.embed_tokens.weight"
    wrong = next(v for v in body["weight_map"].values() if v != body["weight_map"][key])
    index.write_text(json.dumps({"weight_map": {**body["weight_map"], key: wrong}}))
    with pytest.raises(CheckpointFormatError, match=rf"maps '{key}' to {wrong}, which has no such tensor"):
        StateReader(tmp_path / "c", Identity([key]))
    index.write_text(json.dumps({"weight_map": {**body["weight_map"], key: "gone.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match=r"lists 'gone.safetensors', which does not exist"):
        StateReader(tmp_path / "c", Identity([key]))
    index.write_text("{")
    with pytest.raises(CheckpointFormatError, match="corrupt index"):
        StateReader(tmp_path / "c", Identity([key]))
    with pytest.raises(CheckpointFormatError, match="no checkpoint here"):
        resolve_checkpoint(tmp_path)


def test_writer_refuses_and_cleans_up(tmp_path):
    state = {"a": torch.ones(2), "b": torch.zeros(3)}
    save_model_state(tmp_path / "c", state)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_model_state(tmp_path / "c", state)
    # incomplete: the mapper needs 'b' which never comes
    writer = StateWriter(tmp_path / "d", Identity(["a", "b"]))
    writer.add("a", state["a"])
    with pytest.raises(
        CheckpointFormatError, match=r"incomplete: 1 group\(s\) still miss 1 input\(s\), e.g. \['b'\]"
    ):
        writer.commit()
    writer = StateWriter(tmp_path / "d", Identity(["a"]))
    with pytest.raises(StateMappingError, match="'zz' is not an input"), writer:
        writer.add("zz", state["a"])
    writer = StateWriter(tmp_path / "d", Stack(["a", "b"], "ab"))
    writer.add("a", state["a"])
    with pytest.raises(StateMappingError, match="'a' was given twice"), writer:
        writer.add("a", state["a"])
    assert not (tmp_path / "d").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temp dirs left
    # overwrite replaces atomically, old content gone
    save_model_state(tmp_path / "c", {"x": torch.full((2,), 7.0)}, overwrite=True)
    assert_bitwise(load_dir(tmp_path / "c"), {"x": torch.full((2,), 7.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_save_several_modules_with_extra_files(tmp_path):
    """Virtual pipeline stages: one rank saves several modules into one checkpoint, config alongside."""
    a, b = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    stages = [torch.nn.ModuleDict({"first": a}), torch.nn.ModuleDict({"second": b})]
    dest = save_model_state(tmp_path / "c", stages, extra_files={"config.json": '{"x": 1}'})
    expected = {f"first.{k}": v for k, v in a.state_dict().items()}
    expected.update({f"second.{k}": v for k, v in b.state_dict().items()})
    assert_bitwise(load_dir(dest), expected)
    assert json.loads((dest / "config.json").read_text()) == {"x": 1}
    with pytest.raises(StateMappingError, match=r"'first.weight' is in two of the modules"):
        save_model_state(tmp_path / "d", [stages[0], stages[0]])
    with pytest.raises(ValueError, match=r"extra_files: 'model.safetensors' must be a plain file name"):
        save_model_state(tmp_path / "d", stages, extra_files={"model.safetensors": ""})


def test_progress_bar_only_when_asked_or_interactive(tmp_path, capsys):
    save_model_state(tmp_path / "c", {"a": torch.ones(4)}, progress=True)
    list(read_model_state(tmp_path / "c", Identity(["a"]), progress=True))
    err = capsys.readouterr().err
    assert "saving c" in err and "loading c" in err
    save_model_state(tmp_path / "d", {"a": torch.ones(4)})  # pytest's stderr is not a tty
    list(read_model_state(tmp_path / "d", Identity(["a"])))
    assert capsys.readouterr().err == ""


_SLOW_WRITER = """
import sys, time, torch
from d9d.state import Identity, StateWriter
keys = [f"t{i:03d}" for i in range(200)]
# max_shard_bytes=1: a file per tensor
with StateWriter(sys.argv[1], Identity(keys), max_shard_bytes=1, overwrite=True) as writer:
    for i, key in enumerate(keys):
        writer.add(key, torch.full((1000,), float(i)))
        print(key, flush=True)
        time.sleep(0.02)
"""


def _kill_mid_save(dest: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(dest)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "t010":  # several shard files are on disk by now
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_killed_writer_leaves_no_checkpoint_a_reader_accepts(tmp_path):
    dest = tmp_path / "ckpt"
    _kill_mid_save(dest)
    assert not dest.exists()
    (partial,) = tmp_path.glob(".ckpt.partial-*")
    assert len(list(partial.glob("*.safetensors"))) >= 10  # the save really was interrupted mid-way
    for path in (dest, partial):
        with pytest.raises(CheckpointFormatError, match="no checkpoint here"):
            StateReader(path, Identity(["t000"]))
    # With a previous checkpoint in place, an interrupted overwrite leaves it intact.
    old = {"t000": torch.full((3,), 42.0)}
    save_model_state(dest, old)
    _kill_mid_save(dest)
    assert_bitwise(load_dir(dest), old)
    assert_bitwise(dict(read_model_state(dest, Identity(["t000"]))), old)


@pytest.mark.gpu
def test_load_into_and_save_from_cuda_module(tmp_path):
    ref = torch.nn.Linear(16, 8).to(torch.bfloat16)
    save_file(ref.state_dict(), str(tmp_path / "m.safetensors"))
    module = torch.nn.Linear(16, 8, device="cuda", dtype=torch.bfloat16)
    load_model_state(tmp_path / "m.safetensors", module)
    assert module.weight.is_cuda
    assert_bitwise({k: v.cpu() for k, v in module.state_dict().items()}, ref.state_dict())
    dest = save_model_state(tmp_path / "out", module, Rename({"weight": "w", "bias": "b"}))
    assert_bitwise(load_dir(dest), {"w": ref.weight.data, "b": ref.bias.data})
