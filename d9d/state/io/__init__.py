"""Streaming safetensors I/O driven by a state mapper.

- `StateReader(source, mapper)` / `read_model_state(...)`: iterate `(key, tensor)` of the mapper's
  outputs while reading a checkpoint file by file; `load_model_state(source, module, mapper)` copies
  them into a module (DTensor shards placed directly).
- `StateWriter(dest, mapper, max_shard_bytes=..., distributed=..., write="auto", extra_files=...)` /
  `save_model_state(dest, module | [modules] | state_dict, mapper, **writer_options)`: atomic, sharded,
  HF-style (`model.safetensors` or shards + `model.safetensors.index.json`).
- `format`: header validation, `INDEX_NAME`, `SINGLE_NAME`, `resolve_checkpoint`.
"""

from d9d.state.io.format import INDEX_NAME, SINGLE_NAME, read_header, resolve_checkpoint
from d9d.state.io.module import load_model_state, save_model_state
from d9d.state.io.reader import StateReader, read_model_state
from d9d.state.io.writer import DEFAULT_MAX_SHARD_BYTES, StateWriter

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_NAME",
    "SINGLE_NAME",
    "StateReader",
    "StateWriter",
    "load_model_state",
    "read_header",
    "read_model_state",
    "resolve_checkpoint",
    "save_model_state",
]
