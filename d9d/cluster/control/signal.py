"""One condition every waiting client call and the controller share: any change wakes them all."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable


class Changes:
    def __init__(self) -> None:
        self._changed = asyncio.Condition()

    async def notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Return once `predicate` holds or after `timeout_s`, whichever comes first."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout_s)
