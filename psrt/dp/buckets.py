"""How gradients are grouped into buckets, planned as data, in bytes for every strategy.

A bucket is a list of parameters; when backward has finished accumulating the
gradient of its last member, one collective carries the whole bucket (an allreduce for
``DistributedOptimizer``, a reduce-scatter for ZeRO).
Parameters are taken in the order their gradients become ready in backward
(the reverse of registration order), so the first buckets fill first and their
allreduces overlap the rest of backward.  The plan is a pure function of
tensor sizes: it is computed, and can be tested, without any communication.

Sizes are bytes everywhere: ``Bucketing``'s caps, and ZeRO's bucket sizes, which it takes in
elements as DeepSpeed does and turns into bytes before planning.  The gradient reducer
(:mod:`psrt.dp.reducer`) can give each planned bucket one flat buffer whose views are its
parameters' gradients, so a bucket is reduced as one contiguous message, in place.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import torch

from psrt.comm import streams

#: DDP's defaults: a small first bucket so communication starts early in backward,
#: then buckets large enough to amortise each allreduce's latency.
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


@dataclass(frozen=True)
class Bucketing:
    """How DistributedOptimizer groups gradients into allreduces (psrt's addition to Horovod's
    arguments; DDP calls the caps ``bucket_cap_mb``).

    A bucket is closed once it holds at least its cap in bytes (the first bucket of each dtype
    uses ``first_bucket_bytes``).  With ``overlap`` a bucket's allreduce starts during backward
    as soon as its last gradient is accumulated; without it every bucket starts in
    ``synchronize()``.  ``None`` (the default) decides with :func:`overlap_pays`.
    """

    first_bucket_bytes: int = FIRST_BUCKET_BYTES
    bucket_bytes: int = BUCKET_BYTES
    overlap: bool | None = None

    def __post_init__(self) -> None:
        for field in ("first_bucket_bytes", "bucket_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Bucketing.{field} must be a positive int (bytes), got {value!r}")
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise ValueError(f"Bucketing.overlap must be a bool or None, got {self.overlap!r}")


def overlap_pays(devices: Iterable[torch.device], ranks_on_host: int, host_cores: int,
                 threads_per_rank: int) -> bool:
    """Whether overlapping allreduces with backward can hide them.

    Only if communication has resources that backward does not use: GPU gradients
    (NCCL moves them while the GPU computes), or CPU cores to spare for every rank's engine
    thread.  On CPU, an allreduce is CPU work (copies and the reduction); when the host's
    ranks already fill every core, running it during backward slows backward by more than
    it saves (benchmarks/RESULTS.md: 2 ranks on 2 cores).
    """
    if any(streams.api().covers(device) for device in devices):
        return True
    return host_cores >= ranks_on_host * (threads_per_rank + 1)


@dataclass(frozen=True)
class Slot:
    """One tensor to place; tensors with different keys (dtype, device) never share a bucket."""

    numel: int
    element_size: int
    key: Hashable


@dataclass(frozen=True)
class PlannedBucket:
    """Tensors of one key reduced together: ``members`` are slot indices in ready order."""

    key: Hashable
    members: tuple[int, ...]


def plan_buckets(slots: Sequence[Slot], groups: Sequence[Sequence[int]] | None = None, *,
                 first_bucket_bytes: int = FIRST_BUCKET_BYTES,
                 bucket_bytes: int = BUCKET_BYTES) -> list[PlannedBucket]:
    """Buckets for ``slots`` (given in ready order), ordered by when their first member is ready.

    Without ``groups``, consecutive slots of each key fill buckets up to the byte caps.  With
    ``groups`` (lists of slot indices covering every slot once), each group becomes one bucket
    per key it contains, whatever its size.
    """
    if groups is None:
        member_lists = _fill_by_size(slots, first_bucket_bytes, bucket_bytes)
    else:
        member_lists = _split_groups_by_key(slots, groups)
    member_lists.sort(key=lambda members: members[0])
    return [PlannedBucket(slots[members[0]].key, tuple(members)) for members in member_lists]


def split_evenly(count: int, parts: int) -> list[list[int]]:
    """``range(count)`` in ``parts`` contiguous runs whose lengths differ by at most one, longer
    runs first (Horovod's meaning of ``groups=<int>``); empty runs are dropped."""
    base, extra = divmod(count, parts)
    runs, start = [], 0
    for part in range(parts):
        stop = start + base + (1 if part < extra else 0)
        runs.append(list(range(start, stop)))
        start = stop
    return [run for run in runs if run]


def _fill_by_size(slots: Sequence[Slot], first_bucket_bytes: int, bucket_bytes: int) -> list[list[int]]:
    closed: list[list[int]] = []
    open_members: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    closed_per_key: dict[Hashable, int] = {}
    for index, slot in enumerate(slots):
        open_members.setdefault(slot.key, []).append(index)
        open_bytes[slot.key] = open_bytes.get(slot.key, 0) + slot.numel * slot.element_size
        cap = bucket_bytes if closed_per_key.get(slot.key) else first_bucket_bytes
        if open_bytes[slot.key] >= cap:
            closed.append(open_members.pop(slot.key))
            open_bytes[slot.key] = 0
            closed_per_key[slot.key] = closed_per_key.get(slot.key, 0) + 1
    return closed + list(open_members.values())


def _split_groups_by_key(slots: Sequence[Slot], groups: Sequence[Sequence[int]]) -> list[list[int]]:
    seen = sorted(index for group in groups for index in group)
    if seen != list(range(len(slots))):
        raise ValueError(f"groups must cover each of the {len(slots)} slots exactly once, got {groups}")
    member_lists = []
    for group in groups:
        by_key: dict[Hashable, list[int]] = {}
        for index in sorted(group):
            by_key.setdefault(slots[index].key, []).append(index)
        member_lists.extend(by_key.values())
    return member_lists

