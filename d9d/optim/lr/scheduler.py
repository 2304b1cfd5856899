"""The torch LR scheduler driving a resolved piecewise schedule."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from d9d.optim.lr.config import PiecewiseScheduleConfig
from d9d.optim.lr.schedule import PiecewiseSchedule

_STATE_KEYS = ("last_epoch", "_step_count", "base_lrs")


class PiecewiseLR(LRScheduler):
    """Sets each param group's LR to its base LR times the schedule's multiplier at the current step.

    The state dict holds only counters and base LRs, never the schedule: the schedule comes from config
    on resume, so a run may be resumed with an extended or edited schedule. Base LRs equal over all groups
    are saved as one value, which loads into an optimizer with any number of groups: pipeline stages may
    hold different numbers of groups (a weight-decay exemption group with no parameter on a stage is left
    out), and every stage's scheduler is restored from one saved state (`PipelinedLRScheduler`).
    """

    def __init__(self, optimizer: Optimizer, schedule: PiecewiseSchedule, last_epoch: int = -1) -> None:
        self.schedule = schedule
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float | Tensor]:
        multiplier = self.schedule.multiplier(self.last_epoch)
        return [base_lr * multiplier for base_lr in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        state = {key: self.__dict__[key] for key in _STATE_KEYS}
        if len(self.base_lrs) > 1 and len(set(self.base_lrs)) == 1:
            state["base_lrs"] = list(self.base_lrs[:1])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [key for key in _STATE_KEYS if key not in state_dict]
        if missing:
            raise KeyError(f"PiecewiseLR state dict lacks {missing}")
        base_lrs = list(state_dict["base_lrs"])
        groups = len(self.optimizer.param_groups)
        if len(base_lrs) == 1:
            base_lrs = base_lrs * groups
        elif len(base_lrs) != groups:
            raise ValueError(
                f"PiecewiseLR state has {len(base_lrs)} different base LRs, the optimizer has {groups} "
                "param groups"
            )
        for key in _STATE_KEYS:
            self.__dict__[key] = state_dict[key]
        self.base_lrs = base_lrs
        # The optimizer may be restored from elsewhere (or not at all): make its LRs match the step.
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            if isinstance(group["lr"], Tensor):
                group["lr"].fill_(float(lr))
            else:
                group["lr"] = lr
        self._last_lr = [
            group["lr"].clone() if isinstance(group["lr"], Tensor) else group["lr"]
            for group in self.optimizer.param_groups
        ]


def build_piecewise_lr(
    config: PiecewiseScheduleConfig, optimizer: Optimizer, total_steps: int | None = None
) -> PiecewiseLR:
    """The scheduler a config describes, for a run of `total_steps` optimizer steps."""
    return PiecewiseLR(optimizer, config.resolve(total_steps))
