"""The metrics a step's event subscribers record, logged with the step."""

from __future__ import annotations

from collections.abc import Callable


class StepMetrics(dict[str, float]):
    """`name → value` written during a step by event subscribers (e.g. MoE balance), logged with the step on
    the steps the reporter logs.

    `defer(key, fill)`: `fill(metrics)` writes its values when the metrics are read (`resolve`, which the step
    reporter calls on the steps it logs). A subscriber whose values live on the device queues their copy to
    the host and defers reading them, so the steps that log nothing never wait for the device on its account.
    A later `defer` under the same key replaces an unresolved one: what is logged is the newest step's."""

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[str, Callable[[StepMetrics], None]] = {}

    def defer(self, key: str, fill: Callable[[StepMetrics], None]) -> None:
        self._pending[key] = fill

    def resolve(self) -> None:
        pending, self._pending = self._pending, {}
        for fill in pending.values():
            fill(self)
