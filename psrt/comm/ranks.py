"""Ranks as people read them in reports: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
from __future__ import annotations

import itertools
from typing import Iterable


def rank_ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    ordered = sorted(set(ranks))
    runs = []
    for _, group in itertools.groupby(enumerate(ordered), lambda pair: pair[1] - pair[0]):
        run = [r for _, r in group]
        runs.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(runs)
