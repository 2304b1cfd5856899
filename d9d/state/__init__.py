"""Model state: graph-based mappers (`d9d.state.mapper`) and streaming safetensors I/O (`d9d.state.io`)."""

from d9d.state.errors import CheckpointFormatError, StateMappingError
from d9d.state.mapper import *  # noqa: F403 - the mapper API is the package's API
from d9d.state.mapper import __all__ as _mapper_all

__all__ = ["CheckpointFormatError", "StateMappingError", *_mapper_all]
