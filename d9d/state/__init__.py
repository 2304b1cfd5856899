"""Model state: graph-based mappers (`d9d.state.mapper`) and streaming safetensors I/O (`d9d.state.io`).

Everything public in both subpackages is re-exported here; see their docstrings for the API summary.
"""

from d9d.state.errors import CheckpointFormatError, StateMappingError
from d9d.state.io import *  # noqa: F403 - re-export
from d9d.state.io import __all__ as _io_all
from d9d.state.mapper import *  # noqa: F403 - re-export
from d9d.state.mapper import __all__ as _mapper_all

__all__ = ["CheckpointFormatError", "StateMappingError", *_io_all, *_mapper_all]
