"""Inputs checked before anything starts: the tokenizer's vocabulary fits the model's, validation errors name
the key path as written, config files and `--set` overrides are size-capped with YAML aliases bounded (an
alias bomb is refused without being expanded), and safetensors headers follow the `safetensors` library's
own offset rules (checked against the library on the same crafted files)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import safetensors.torch
import torch
import yaml

from d9d.cli.main import main
from d9d.engine.config import MAX_ALIAS_VALUES, MAX_CONFIG_BYTES, ConfigError, load_config, parse_config
from d9d.state.errors import CheckpointFormatError
from d9d.state.io.format import read_header
from tests.test_trust_preflight import _engine_job, _refused

# -- preflight: tokenizer vocabulary ------------------------------------------------------------------------


def _word_tokenizer(path: Path, size: int) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def _hf_tokenizer_job(tmp_path: Path, size: int) -> dict[str, Any]:
    job = _engine_job(tmp_path)
    tokenizer = {
        "kind": "hf",
        "path": str(_word_tokenizer(tmp_path / "tokenizer.json", size)),
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "eos_token": "</s>",
    }
    job["data"]["options"]["dataset"]["tokenizer"] = tokenizer
    return job


def test_a_tokenizer_with_more_ids_than_the_model_is_refused_before_ray(tmp_path: Path) -> None:
    assert not ray.is_initialized()
    message = _refused(_hf_tokenizer_job(tmp_path, 512))  # the case: 512 ids, vocab_size 259
    assert (
        "data.options.dataset.tokenizer: has 512 token ids, more than model.options.architecture.vocab_size "
        "(259): ids from 259 on would index past the model's embedding" in message
    ), message


def test_a_tokenizer_that_fits_passes(tmp_path: Path) -> None:
    from d9d.cluster.client import preflight_job
    from d9d.cluster.spec import build_job

    preflight_job(build_job(_hf_tokenizer_job(tmp_path, 259)))  # equal sizes: every id has a row


# -- validation errors name the path as written -----------------------------------------------------------


MOE_JOB = """\
run: {name: paths}
batching: {global_batch_size: 4, microbatch_size: 1}
trainer: {total_steps: 2}
model:
  provider: qwen3_moe
  options:
    architecture: {vocab_size: 259, hidden_size: 32, num_layers: 2, num_attention_heads: 4, num_kv_heads: 2,
                   head_dim: 8, intermediate_size: 64, moe_intermediate_size: 16, num_experts: 4,
                   num_experts_per_tok: 2}
data: {provider: text, options: {dataset: {paths: [corpus.txt]}}}
"""


@pytest.mark.parametrize(
    ("override", "wanted"),
    [
        ("model.options.architecture.num_expert=8", "model.options.architecture.num_expert: Extra inputs"),
        ("data.options.dataset.max_lenght=8", "data.options.dataset.max_lenght: Extra inputs"),
        (
            "model.options.architecture.num_experts=many",
            "model.options.architecture.num_experts: Input should",
        ),
        ("data.options.dataset.max_length=long", "data.options.dataset.max_length: Input should be"),
        ("trainer.totl_steps=3", "trainer.totl_steps: Extra inputs"),
        ("task.provider=causal_lm,task.options.weight=2", "task.options.weight: Extra inputs"),
    ],
)
def test_nested_validation_errors_name_the_key_path_as_written(
    tmp_path: Path, override: str, wanted: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(MOE_JOB)
    with pytest.raises(ConfigError) as error:
        load_config(path, override.split(","))
    lines = str(error.value).splitlines()[1:]
    assert any(line.strip().startswith(wanted) for line in lines), lines


def test_plugin_option_errors_name_the_path_as_written(tmp_path: Path) -> None:
    job = _engine_job(tmp_path)
    job["model"] = {"provider": "tests.engine_fixtures:TinyLMProvider", "options": {"widht": 8}}
    with pytest.raises(ConfigError, match=r"model.options.widht: Extra inputs are not permitted"):
        parse_config(job)


# -- bounded inputs ----------------------------------------------------------------------------------------


def _bomb(levels: int = 6, width: int = 10) -> str:
    """`levels` anchors, each a list of `width` aliases of the one before: width**levels leaves in ~1 kB."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines)


def test_an_alias_bomb_in_the_job_file_is_refused_without_expanding_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bomb = _bomb()
    assert len(bomb) < 1100
    hparams = "\n".join("    " + line for line in bomb.splitlines())
    path = tmp_path / "job.yaml"
    path.write_text(MOE_JOB.replace("run: {name: paths}", "run:\n  name: paths\n  hparams:\n" + hparams))
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"{path}: YAML aliases \(\*name\) expand to more than 100,000"):
        load_config(path)
    assert time.perf_counter() - start < 5  # the shared structure is measured, never expanded
    # The CLI: status 2, one line, before Ray.
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "YAML aliases (*name) expand to more than" in err and "Traceback" not in err
    assert not ray.is_initialized()


def test_the_same_bomb_through_set_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(MOE_JOB)
    flow = "{" + ", ".join(line.replace(": ", ": ", 1) for line in _bomb().splitlines()) + "}"
    assert yaml.safe_load(flow)["a5"][0][0][0][0][0][0] == "x"  # a real bomb, as written
    with pytest.raises(ConfigError, match=r"--set run.hparams.b value .*YAML aliases \(\*name\) expand"):
        load_config(path, [f"run.hparams.b={flow}"])


def test_a_few_aliases_are_fine_and_recursive_ones_are_not(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        MOE_JOB.replace("run: {name: paths}", "run:\n  name: paths\n  hparams: {a: &x [1, 2], b: *x}")
    )
    assert load_config(path).run.hparams == {"a": [1, 2], "b": [1, 2]}
    path.write_text(MOE_JOB.replace("run: {name: paths}", "run:\n  name: paths\n  hparams: &h {self: *h}"))
    with pytest.raises(ConfigError, match="refers to a node that contains it"):
        load_config(path)
    assert MAX_ALIAS_VALUES == 100_000


def test_oversized_job_files_and_overrides_are_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    with path.open("w") as f:
        f.write(MOE_JOB + "#" * (MAX_CONFIG_BYTES + 1) + "\n")
    start = time.perf_counter()
    with pytest.raises(
        ConfigError, match=r"is 4,194,\d{3} bytes, more than the 4,194,304 a job file may have"
    ):
        load_config(path)
    assert time.perf_counter() - start < 1
    path.write_text(MOE_JOB)
    with pytest.raises(
        ConfigError, match=r"--set run.description: the value is 70,000 bytes, more than the 65,536"
    ):
        load_config(path, ["run.description=" + "x" * 70_000])
    many = [f"run.hparams.k{i}=" + "y" * 60_000 for i in range(20)]
    with pytest.raises(ConfigError, match=r"--set values are .* bytes together, more than the 1,048,576"):
        load_config(path, many)


# -- safetensors headers -----------------------------------------------------------------------------------


def _write(path: Path, entries: dict[str, tuple[str, list[int], int, int]], data: bytes) -> Path:
    header = {k: {"dtype": d, "shape": s, "data_offsets": [b, e]} for k, (d, s, b, e) in entries.items()}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


EIGHT = bytes(range(32))  # room for a few float32 tensors
CASES: dict[str, tuple[dict[str, tuple[str, list[int], int, int]], bytes, str | None]] = {
    "contiguous": ({"k": ("F32", [2], 0, 8), "v": ("F32", [2], 8, 16)}, EIGHT[:16], None),
    "listed out of order, contiguous": (
        {"v": ("F32", [2], 8, 16), "k": ("F32", [2], 0, 8)},
        EIGHT[:16],
        None,
    ),
    "empty tensor": (
        {"k": ("F32", [2], 0, 8), "e": ("F32", [0], 8, 8), "v": ("F32", [2], 8, 16)},
        EIGHT[:16],
        None,
    ),
    "v at k's bytes (overlap)": (
        {"k": ("F32", [2], 0, 8), "v": ("F32", [2], 0, 8), "w": ("F32", [2], 8, 16)},
        EIGHT[:16],
        "'v' overlaps 'k'",
    ),
    "partial overlap": ({"k": ("F32", [2], 0, 8), "v": ("F32", [2], 4, 12)}, EIGHT[:12], "'v' overlaps 'k'"),
    "hole": ({"k": ("F32", [2], 0, 8), "v": ("F32", [2], 12, 20)}, EIGHT[:20], "'v' leaves a hole"),
    "hole at the start": ({"k": ("F32", [2], 4, 12)}, EIGHT[:12], "'k' leaves a hole"),
    "trailing bytes": ({"k": ("F32", [2], 0, 8)}, EIGHT[:12], "4 bytes no tensor covers"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_safetensors_headers_follow_the_library_rules(tmp_path: Path, case: str) -> None:
    entries, data, problem = CASES[case]
    path = _write(tmp_path / "x.safetensors", entries, data)
    try:
        safetensors.torch.load_file(path)
        library_accepts = True
    except Exception:  # the library's SafetensorError
        library_accepts = False
    assert library_accepts == (problem is None), case  # the independent reference agrees with the table
    if problem is None:
        assert set(read_header(path).entries) == set(entries)
    else:
        with pytest.raises(CheckpointFormatError, match=rf"{path}: invalid offsets, .*{problem}"):
            read_header(path)


def test_a_source_checkpoint_with_overlapping_tensors_fails_preflight(tmp_path: Path) -> None:
    """The issue's case: `v_proj.weight` pointed at `k_proj.weight`'s bytes passed preflight and trained
    with v_proj == k_proj."""
    from d9d.engine.preflight import check_source_checkpoint
    from d9d.models.hf.config import config_from_hf
    from tests.engine_fixtures import make_hf_qwen3

    source = tmp_path / "hf"
    make_hf_qwen3(source, num_layers=1)
    file = source / "model.safetensors"
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"
    assert header[k]["shape"] == header[v]["shape"]
    header[v]["data_offsets"] = header[k]["data_offsets"]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])
    with pytest.raises(Exception, match="invalid offset"):
        safetensors.torch.load_file(file)  # the library refuses it
    model = config_from_hf(json.loads((source / "config.json").read_text()))
    with pytest.raises(
        ConfigError, match=rf"source: .*invalid offsets, '{v}' overlaps '{k}'|{k}' overlaps '{v}"
    ):
        check_source_checkpoint(model, source, "source")
    assert torch.__version__  # torch stays imported for the fixture's model
