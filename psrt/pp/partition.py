"""Which consecutive blocks of a model each pipeline stage holds: a plain value,
balanced by parameter count or given explicitly."""
from __future__ import annotations

from typing import Sequence

from psrt.errors import ArgumentTypeError, InvalidArgumentError


def balanced_split(sizes: Sequence[int], stages: int) -> list[range]:
    """Cut ``sizes`` (one cost per block, e.g. its parameter count) into ``stages``
    consecutive non-empty ranges minimising the largest stage's total."""
    n = len(sizes)
    _check_stages(n, stages)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[s][i]: the smallest largest-stage cost of cutting blocks [0, i) into s stages
    best = [[float("inf")] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, end = [], n
    for s in range(stages, 0, -1):
        bounds.append(range(cut[s][end], end))
        end = cut[s][end]
    return bounds[::-1]


def explicit_split(blocks: int, counts: Sequence[int]) -> list[range]:
    """Ranges for ``counts[s]`` consecutive blocks on stage ``s``."""
    if isinstance(counts, (str, bytes)) or not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        raise ArgumentTypeError(f"split must be a sequence of ints (blocks per stage), got {counts!r}")
    if any(c < 1 for c in counts) or sum(counts) != blocks:
        raise InvalidArgumentError(f"split {list(counts)} must give every stage at least one block and cover all "
                                   f"{blocks} blocks (sum {sum(counts)})")
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


def _check_stages(blocks: int, stages: int) -> None:
    if stages > blocks:
        raise InvalidArgumentError(f"more pipeline stages ({stages}) than blocks ({blocks}): every stage needs at "
                                   "least one block")
