"""A data provider that writes down which global samples each data-parallel rank trained, for the elastic
tests of the real engine: `GlobalIndexData` (step s uses global samples [s*G, (s+1)*G), DP rank d its
contiguous slice) plus one JSON line per step and rank in `<log_dir>/<pid>.jsonl`."""

from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.engine_fixtures import GlobalIndexData

_HEADER = re.compile(r"---- d9d rank \d+ of \d+, attempt (?P<attempt>\d+), pid (?P<pid>\d+) ----")


class LoggedIndexData(GlobalIndexData):
    class Config(GlobalIndexData.Config):
        log_dir: str

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.log = Path(config.log_dir) / f"{os.getpid()}.jsonl"
        self.log.parent.mkdir(parents=True, exist_ok=True)

    def next_step(self) -> Any:
        s = self.s
        per_rank = s.global_batch_size // s.dp_size
        entry = {
            "step": self.step + 1,
            "dp_rank": s.dp_rank,
            "dp_size": s.dp_size,
            "first": self.step * s.global_batch_size + s.dp_rank * per_rank,
            "count": per_rank,
            "t": time.time_ns(),
        }
        with self.log.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        return super().next_step()


def attempts_by_pid(run_dir: Path) -> dict[int, int]:
    """Rank process id -> attempt, from the header every rank writes to its log (`d9d.cluster.rank`)."""
    found: dict[int, int] = {}
    for path in (run_dir / "logs").glob("rank*.log"):
        for match in _HEADER.finditer(path.read_text(errors="replace")):
            found[int(match["pid"])] = int(match["attempt"])
    return found


def samples_by_attempt(log_dir: Path, run_dir: Path) -> dict[int, dict[int, list[int]]]:
    """Attempt -> data step -> the global sample indices its DP ranks drew for it, in DP rank order (the
    data provider's own count of steps, independent of the trainer's)."""
    attempt_of = attempts_by_pid(run_dir)
    entries: dict[int, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path in log_dir.glob("*.jsonl"):
        attempt = attempt_of[int(path.stem)]
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            entries[attempt][entry["step"]].append(entry)
    result: dict[int, dict[int, list[int]]] = {}
    for attempt, steps in sorted(entries.items()):
        result[attempt] = {}
        for step, drawn in sorted(steps.items()):
            drawn.sort(key=lambda e: e["dp_rank"])
            size = drawn[0]["dp_size"]
            ranks = [e["dp_rank"] for e in drawn]
            # A step an attempt died in may have been drawn by some of its ranks only.
            if len(set(ranks)) != len(ranks) or {e["dp_size"] for e in drawn} != {size}:
                raise AssertionError(f"attempt {attempt} step {step}: two draws of one DP rank: {drawn}")
            result[attempt][step] = [i for e in drawn for i in range(e["first"], e["first"] + e["count"])]
    return result
