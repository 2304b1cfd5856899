"""Loggers whose records say which rank (and where in the mesh) they come from.

On a 64-rank job an unlabelled log line is useless; every record carries the global rank and the
rank's mesh coordinates, both as a message prefix and as record attributes for structured handlers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from typing import Any

_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class RankLoggerAdapter(logging.LoggerAdapter[logging.Logger]):
    def __init__(self, logger: logging.Logger, rank: int, coords: Mapping[str, int]) -> None:
        super().__init__(logger, {"rank": rank, "mesh_coords": dict(coords)})
        shown = " ".join(f"{k}={v}" for k, v in coords.items() if k != "world")
        self._prefix = f"[rank {rank}{' ' + shown if shown else ''}]"

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        extra = dict(self.extra or {})
        extra.update(kwargs.get("extra") or {})
        kwargs["extra"] = extra
        return f"{self._prefix} {msg}", kwargs


def build_rank_logger(rank: int, coords: Mapping[str, int], name: str = "d9d") -> RankLoggerAdapter:
    logger = logging.getLogger(name)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return RankLoggerAdapter(logger, rank, coords)
