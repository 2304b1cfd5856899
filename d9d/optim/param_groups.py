"""Parameter groups with weight-decay exemptions, chosen by parameter name and shape.

Names are the ones a model's state dict (and so a checkpoint) uses: `parameter_name` removes the segments
that module wrappers insert (`_checkpoint_wrapped_module` of torch's activation-checkpoint wrapper,
`_orig_mod` of a `torch.compile`d module, `_fsdp_wrapped_module` of FSDP1), as torch's distributed
state-dict API does. FSDP2 (`fully_shard`), tensor/expert parallelism and d9d's PEFT injection keep names.

    exemptions = DecayExemptions(patterns=(r"model\\.embed_tokens\\.weight",), one_dimensional=True)
    groups = exemptions.param_groups(model.named_parameters(), weight_decay=0.1)
    torch.optim.AdamW(groups, lr=3e-4)  # [decayed, exempt with weight_decay 0]; an empty one left out
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})


def parameter_name(name: str) -> str:
    """`name` (from `named_parameters()`) as the state dict names it: wrapper segments removed."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class DecayExemptions:
    """Which parameters train without weight decay: those whose whole name matches one of `patterns`
    (`re.fullmatch`), and with `one_dimensional` every parameter of at most one dimension (norm weights,
    biases, scalars; the full tensor's dimensions, also for a sharded DTensor)."""

    patterns: tuple[str, ...] = ()
    one_dimensional: bool = False

    def __post_init__(self) -> None:
        for i, pattern in enumerate(self.patterns):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"[{i}] {pattern!r} is not a regular expression ({e})") from None

    @property
    def enabled(self) -> bool:
        return bool(self.patterns) or self.one_dimensional

    def exempt(self, name: str, param: nn.Parameter) -> bool:
        return (self.one_dimensional and param.ndim <= 1) or any(re.fullmatch(p, name) for p in self.patterns)

    def param_groups(
        self, named_parameters: Iterable[tuple[str, nn.Parameter]], weight_decay: float
    ) -> list[dict[str, Any]]:
        """The trainable parameters (`requires_grad`) in two groups, in their order: decayed by
        `weight_decay`, and exempt (`weight_decay` 0). A group without parameters is left out (torch's
        distributed optimizer state dict cannot load an empty group)."""
        decay: list[nn.Parameter] = []
        exempt: list[nn.Parameter] = []
        for name, param in named_parameters:
            if param.requires_grad:
                (exempt if self.exempt(name, param) else decay).append(param)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
        return [group for group in groups if group["params"]]

    def unmatched(self, names: Collection[str]) -> list[tuple[int, str]]:
        """`(index, pattern)` of each pattern that fully matches none of `names`."""
        return [
            (i, pattern)
            for i, pattern in enumerate(self.patterns)
            if not any(re.fullmatch(pattern, name) for name in names)
        ]

    def check_matches(self, names: Collection[str], key: str = "no_weight_decay") -> None:
        """Raise a `ValueError` naming every pattern that fully matches none of `names` (the parameter names
        of the whole model: a pattern that matches nothing is a typo, not a choice), with the closest names
        as hints."""
        problems = []
        ordered = sorted(names)
        for i, pattern in self.unmatched(names):
            close = difflib.get_close_matches(pattern.replace("\\", ""), ordered, n=3, cutoff=0.6)
            hint = f"closest: {', '.join(close)}" if close else f"e.g. {', '.join(ordered[:3]) or 'none'}"
            problems.append(
                f"{key}[{i}] {pattern!r} fully matches no parameter of the model (re.fullmatch against "
                f"{len(ordered)} parameter names; {hint})"
            )
        if problems:
            raise ValueError("; ".join(problems))


def keep_weight_decay_on_load(optimizer: torch.optim.Optimizer) -> None:
    """Make each param group's `weight_decay` survive `optimizer.load_state_dict`: torch takes the group
    hyperparameters from the loaded state (the distributed, flattened form from the group's first
    parameter), so a state saved under other exemptions would silently bring its values back. Call after
    building; the group layout must not change afterwards."""
    configured = [group["weight_decay"] for group in optimizer.param_groups]

    def restore(loaded: torch.optim.Optimizer) -> None:
        for group, weight_decay in zip(loaded.param_groups, configured, strict=True):
            group["weight_decay"] = weight_decay

    optimizer.register_load_state_dict_post_hook(restore)
