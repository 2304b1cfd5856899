"""Checks on the launching process, before any process group, actor or rank exists, for the errors every
rank would otherwise hit during setup (and a restart would only repeat): data files that are missing or
unreadable, a tokenizer that does not load, model sizes the mesh cannot split, a Hugging Face source
checkpoint that is incomplete or holds tensors of other shapes.

Plug-in modules are imported (and checked against their protocols) when the config is parsed
(`d9d.engine.registry.validate_components`); what a plug-in reads is its own business and is not checked
here. Every error is a `ConfigError` naming the config field and, where there is one, the file.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from d9d.core.mesh_params import DeviceMeshParameters
from d9d.data.sources.config import HFDatasetConfig, TextDatasetConfig, check_dataset
from d9d.data.tokenizers.config import build_tokenizer
from d9d.engine.builtin.models import CausalLMProvider
from d9d.engine.components import BuiltinModel, DataPlugin, ModelPlugin, TextData
from d9d.engine.config import TrainConfig
from d9d.engine.errors import ConfigError
from d9d.engine.providers import ModelArchitecture
from d9d.engine.registry import PeftModel, build_model
from d9d.models.family import family_of
from d9d.models.hf.io import build_causal_lm
from d9d.models.hf.mapping import hf_to_d9d_mapper_for
from d9d.state import read_header, resolve_checkpoint
from d9d.state.mapper.base import apply_group


def preflight(config: TrainConfig) -> None:
    """Run every check; raise `ConfigError` on the first problem found."""
    check_data(config)
    check_model(config)
    check_vocabulary(config)


def check_vocabulary(config: TrainConfig) -> None:
    """Every id the text data's tokenizer can produce must index the model's embedding: a tokenizer with
    more ids than `vocab_size` trains until the first such id (`IndexError` on every rank)."""
    models = list(_causal_lms(config))
    if not models:
        return
    field, provider = models[0]
    vocab = provider.model_config.vocab_size
    if not isinstance(provider, CausalLMProvider):
        where = f"the vocab_size of {field}'s model"
    elif provider.options.architecture and "vocab_size" in provider.options.architecture:
        where = f"{field}.options.architecture.vocab_size"
    else:
        where = f"the vocab_size of {field}.options.source_checkpoint"
    sections = [("data", config.data)] + (
        [("eval.data", config.eval.data)] if config.eval is not None else []
    )
    for data_field, section in sections:
        if not isinstance(section, TextData):
            continue
        tokenizer = build_tokenizer(section.options.dataset.tokenizer)
        if tokenizer.vocab_size > vocab:
            raise ConfigError(
                f"{data_field}.options.dataset.tokenizer: has {tokenizer.vocab_size} token ids, more than "
                f"{where} ({vocab}): ids from {vocab} on would index past the model's embedding. Use the "
                f"model's tokenizer, or a vocab_size of at least {tokenizer.vocab_size}"
            )


# -- data ----------------------------------------------------------------------------------------------


def check_data(config: TrainConfig) -> None:
    sections = [("data", config.data)] + (
        [("eval.data", config.eval.data)] if config.eval is not None else []
    )
    for field, section in sections:
        match section:
            case TextData():
                check_text_dataset(section.options.dataset, f"{field}.options.dataset")
            case DataPlugin():
                pass


def check_text_dataset(dataset: TextDatasetConfig | HFDatasetConfig, field: str) -> None:
    """Files readable (named by index), then the source's own checks (`d9d.data.check_dataset`: a Hugging
    Face dataset's split and column, the tokenizer and its special tokens), then the padding token."""
    if isinstance(dataset, TextDatasetConfig):
        for i, path in enumerate(dataset.paths):
            _check_readable(path, f"{field}.paths[{i}]")
    try:
        tokenizer = build_tokenizer(dataset.tokenizer)
    except Exception as e:  # whatever the tokenizer library raises for a file it cannot use
        raise ConfigError(f"{field}.tokenizer: does not load: {type(e).__name__}: {e}") from e
    try:
        check_dataset(dataset)
    except Exception as e:  # whatever the datasets library raises for input it cannot use
        raise ConfigError(f"{field}: {type(e).__name__}: {e}") from e
    if tokenizer.pad_id is None:
        raise ConfigError(f"{field}.tokenizer: has no padding token; the collator needs one")


def _check_readable(path: Path, field: str) -> None:
    if not path.exists():
        raise ConfigError(f"{field}: {path} does not exist (relative paths start at {Path.cwd()})")
    if not path.is_file():
        raise ConfigError(f"{field}: {path} is not a file")
    try:
        with path.open("rb") as f:
            f.read(1)
    except OSError as e:
        raise ConfigError(f"{field}: {path} cannot be read: {e}") from e


# -- model ---------------------------------------------------------------------------------------------


def check_model(config: TrainConfig) -> None:
    for field, provider in _causal_lms(config):
        check_model_mesh(provider.model_config, config.mesh, field)
        source = provider.options.source_checkpoint if isinstance(provider, CausalLMProvider) else None
        if source is not None:
            check_source_checkpoint(provider.model_config, source, f"{field}.options.source_checkpoint")


def _causal_lms(config: TrainConfig) -> Iterator[tuple[str, ModelArchitecture]]:
    """The model of a registered family the job trains (a built-in provider, or a plug-in with the
    `ModelArchitecture` trait), with its key; nothing for other plug-ins, which check their own."""
    model = config.model
    field = "model"
    if isinstance(model, PeftModel):
        model, field = model.options.base, "model.options.base"
    try:
        match model:
            case BuiltinModel():
                provider = build_model(model, field)
                assert isinstance(provider, ModelArchitecture)
                yield field, provider
            case ModelPlugin():
                plugin = build_model(model, field)
                if isinstance(plugin, ModelArchitecture):
                    yield field, plugin
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # the source checkpoint's config.json
        raise ConfigError(f"{field}.options: {e}") from e


def check_model_mesh(model: Any, mesh: DeviceMeshParameters, field: str) -> None:
    """The sizes tensor, expert and pipeline parallelism split must divide evenly (the family names them:
    `ModelFamily.mesh_splits`)."""
    arch = f"{field}.options.architecture"
    pp = mesh.pipeline_parallel
    problems = []
    for split in family_of(model).mesh_splits(model):
        parts = getattr(mesh, split.dim)
        if parts > 1 and split.size % parts:
            problems.append(f"{arch}.{split.field}={split.size} is not divisible by mesh.{split.dim}={parts}")
    if model.num_layers < pp:
        problems.append(
            f"{arch}.num_layers={model.num_layers} is fewer than mesh.pipeline_parallel={pp} stages"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def check_source_checkpoint(model: Any, source: Path, field: str) -> None:
    """Every tensor the model loads is in the checkpoint, in a file that exists, with the shape the model
    expects: the checkpoint's headers (no tensor data) are mapped to model keys on the meta device and
    compared with the whole model built on meta."""
    try:
        key_to_file, layout = resolve_checkpoint(source)
        headers = {path: read_header(path) for path in set(key_to_file.values())}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}: {e}") from e
    entries = {}
    for key, path in key_to_file.items():
        entry = headers[path].entries.get(key)
        if entry is None:
            raise ConfigError(f"{field}: {layout} lists {key!r} in {path.name}, which does not hold it")
        entries[key] = entry
    keys = set(entries)
    mapper = hf_to_d9d_mapper_for(model, keys)
    missing = sorted(mapper.inputs() - keys)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigError(f"{field}: {layout} lacks {', '.join(missing[:5])}{more}")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_causal_lm(model).state_dict().items()}
    for group in mapper.groups():
        inputs = {
            k: torch.empty(entries[k].shape, dtype=entries[k].dtype, device="meta") for k in group.inputs
        }
        try:
            outputs = apply_group(mapper, group, inputs)
        except (RuntimeError, ValueError) as e:  # tensors that cannot be stacked or split as mapped
            shapes = ", ".join(f"{k} {tuple(entries[k].shape)}" for k in sorted(group.inputs))
            raise ConfigError(f"{field}: {shapes} in {layout} do not fit the model: {e}") from e
        for key, tensor in outputs.items():
            want = expected.get(key)
            if want is not None and tuple(tensor.shape) != want:
                origin = ", ".join(f"{k} {tuple(entries[k].shape)}" for k in sorted(group.inputs))
                raise ConfigError(
                    f"{field}: {origin} in {layout} maps to {key} of shape {tuple(tensor.shape)}, but the "
                    f"model's is {want}"
                )
