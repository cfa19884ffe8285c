"""How many samples each rank takes per step when the rank count changes.

Two policies, both common: keep the global batch (each rank takes ``global / size``,
with gradient accumulation where that exceeds what fits at once), so that a relaunched job
follows the same optimisation as before, or keep each rank's batch and scale the learning
rate with the global batch (the linear scaling rule of Goyal et al., 2017).  psrt's
examples keep the global batch: with :class:`~psrt.elastic.ElasticSampler` a step then
takes the same samples at any size, and only the summation order differs.
"""
from __future__ import annotations

from dataclasses import dataclass

from psrt.errors import InvalidArgumentError

POLICIES = ("global", "rank")


@dataclass(frozen=True)
class BatchPlan:
    """One step's batch on this launch: ``rank_batch`` samples on each rank, in
    ``accumulation`` backward passes of ``micro_batch`` each; multiply the base learning
    rate by ``lr_scale``."""

    global_batch: int
    rank_batch: int
    accumulation: int
    lr_scale: float

    @property
    def micro_batch(self) -> int:
        return self.rank_batch // self.accumulation


def plan_batch(global_batch: int, size: int, *, keep: str = "global", base_size: int | None = None,
               max_micro_batch: int | None = None) -> BatchPlan:
    """The batch of a launch with ``size`` ranks for a job set up with ``global_batch``
    samples per step (on ``base_size`` ranks, needed when ``keep="rank"``)."""
    if keep not in POLICIES:
        raise InvalidArgumentError(f"keep={keep!r}: choose 'global' (same global batch, accumulation as "
                                   "needed) or 'rank' (same per-rank batch, learning rate scaled)")
    if global_batch <= 0 or size <= 0:
        raise InvalidArgumentError(f"global batch {global_batch} and size {size} must be positive")
    if keep == "global":
        if global_batch % size:
            fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0 and n <= 4 * size]
            raise InvalidArgumentError(f"a global batch of {global_batch} does not split over {size} ranks; "
                                       f"sizes that work: {fits}; set --min-np/--max-np to those, or keep='rank'")
        rank_batch, lr_scale, total = global_batch // size, 1.0, global_batch
    else:
        if base_size is None or base_size <= 0 or global_batch % base_size:
            raise InvalidArgumentError(f"keep='rank' needs base_size, the rank count the global batch {global_batch} "
                                       f"was set for, dividing it (got {base_size})")
        rank_batch = global_batch // base_size
        total, lr_scale = rank_batch * size, size / base_size
    if max_micro_batch is not None and max_micro_batch < 1:
        raise InvalidArgumentError(f"max_micro_batch={max_micro_batch}: must be at least 1 (or None: no limit)")
    limit = max_micro_batch or rank_batch
    accumulation = next(a for a in range(1, rank_batch + 1) if rank_batch % a == 0 and rank_batch // a <= limit)
    return BatchPlan(total, rank_batch, accumulation, lr_scale)
