"""Type aliases shared across d9d."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import torch

#: A nested structure of tensors as batches and model outputs are: dicts, lists, tuples of tensors.
TensorTree: TypeAlias = torch.Tensor | Mapping[str, "TensorTree"] | Sequence["TensorTree"]
#: Any pytree; leaves may be tensors or plain Python values.
PyTree: TypeAlias = Any
#: A flat mapping of parameter/buffer names to tensors.
StateDict: TypeAlias = dict[str, torch.Tensor]
