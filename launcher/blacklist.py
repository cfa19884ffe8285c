"""Slot groups an elastic job keeps out after a rank was lost in them: Horovod's blacklist.

Horovod keeps a failed host out for the rest of the job, unless ``--blacklist-cooldown-range
LOW HIGH`` is given.  Then the n-th time a host is blacklisted it stays out for ``LOW * 2**n``
seconds plus a random share of ``LOW`` (so that hosts lost together do not all come back
together), never less than ``LOW`` nor more than ``HIGH``, and is used again once that time
is over; the count is never reset, so a host that keeps failing stays out longer each time.
psrun applies the same rule to each slot group (a hostfile line, an ``-H`` entry or a
discovery line).
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

__all__ = ["MAX_COOLDOWN_S", "MIN_COOLDOWN_S", "Blacklist", "check_cooldown_range"]

# Horovod's bounds on --blacklist-cooldown-range.
MIN_COOLDOWN_S = 1.0
MAX_COOLDOWN_S = 3600.0


def check_cooldown_range(low: float, high: float) -> str | None:
    """What is wrong with a cooldown range, or None when it is usable."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"--blacklist-cooldown-range {low:g} {high:g}: both must be finite numbers of seconds"
    if not MIN_COOLDOWN_S <= low <= high <= MAX_COOLDOWN_S:
        return (f"--blacklist-cooldown-range {low:g} {high:g}: need {MIN_COOLDOWN_S:g} <= LOW <= HIGH <= "
                f"{MAX_COOLDOWN_S:g} seconds")
    return None


@dataclass
class Blacklist:
    """Which slot groups are out now; ``cooldown_s`` is (LOW, HIGH), or None to keep a failed
    group out for good.  ``clock`` and ``jitter`` (a number in [0, 1)) are replaceable for tests."""

    cooldown_s: tuple[float, float] | None = None
    clock: Callable[[], float] = time.monotonic
    jitter: Callable[[], float] = random.random
    _times_out: dict[Hashable, int] = field(default_factory=dict)
    _out_until: dict[Hashable, float] = field(default_factory=dict)

    def add(self, key: Hashable) -> float:
        """Keep the group ``key`` out; returns for how many seconds (``math.inf``: for good)."""
        count = self._times_out[key] = self._times_out.get(key, 0) + 1
        if self.cooldown_s is None:
            seconds = math.inf
        else:
            low, high = self.cooldown_s
            seconds = max(low, min(high, low * 2 ** min(count, 64) + self.jitter() * low))  # 2**count overflows
        self._out_until[key] = self.clock() + seconds
        return seconds

    def excludes(self, key: Hashable) -> bool:
        return self.clock() < self._out_until.get(key, -math.inf)

    def returns_later(self) -> bool:
        """Whether some group now out will be usable again (its cooldown has not ended)."""
        now = self.clock()
        return any(now < until < math.inf for until in self._out_until.values())
