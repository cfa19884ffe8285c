"""Counts of the collectives or messages a parallel layer ran, and the seconds spent in them,
for tests (which check how many ran) and benchmarks (which report the communication share)."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Collectives run since the last ``reset``: how many of each kind, and how long."""

    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def reset(self) -> None:
        self.counts.clear()
        self.seconds = 0.0

    def add(self, kind: str, since: float) -> None:
        self.counts[kind] += 1
        self.seconds += time.perf_counter() - since
