"""Which rank owns which elements of which parameter: the ZeRO partition, as a plain value.

Parameters are packed into flat groups (a bucket of gradients for stages 1 and
2, one module's parameters for stage 3).  Each group's flat length is padded up
to a multiple of the shard count and cut into equal contiguous shards, shard r
on rank r of the data-parallel set (FSDP's layout).  Equal shards make every
gradient reduction one reduce-scatter and every parameter gather one
all-gather per group.  The partition is a pure function of the parameters'
sizes and the shard count: every rank computes the same one, and it can be
tested without any communication.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ParamInfo:
    """What the partition needs to know of a parameter; ``dtype`` is its name, e.g. ``float32``."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param`` (flattened), at ``shard_offset`` of a shard."""

    param: int
    start: int
    stop: int
    shard_offset: int


@dataclass(frozen=True)
class FlatGroup:
    """Parameters packed back to back (``offsets[i]`` is where ``params[i]`` starts) and padded
    to ``shard_numel * num_shards`` elements."""

    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    shard_numel: int


@dataclass(frozen=True)
class Partition:
    """The flat groups of ``params`` and their split into ``num_shards`` equal shards."""

    params: tuple[ParamInfo, ...]
    groups: tuple[FlatGroup, ...]
    num_shards: int

    @classmethod
    def build(cls, params: Sequence[ParamInfo], groups: Sequence[Sequence[int]],
              num_shards: int) -> Partition:
        """``groups`` lists parameter indices, covering every parameter exactly once."""
        if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an int >= 1, got {num_shards!r}")
        covered = sorted(index for group in groups for index in group)
        if covered != list(range(len(params))):
            raise ValueError(f"groups must cover each of the {len(params)} parameters exactly once, "
                             f"got {[list(group) for group in groups]}")
        flat = []
        for group in groups:
            if len({params[i].dtype for i in group}) > 1:
                raise ValueError(f"a flat group holds one dtype; parameters {list(group)} mix "
                                 f"{sorted({params[i].dtype for i in group})}")
            sizes = [params[i].numel for i in group]
            offsets = tuple(sum(sizes[:k]) for k in range(len(sizes)))
            numel = sum(sizes)
            flat.append(FlatGroup(tuple(group), offsets, numel, -(-numel // num_shards)))
        return cls(tuple(params), tuple(flat), num_shards)

    def padded_numel(self, group: int) -> int:
        return self.groups[group].shard_numel * self.num_shards

    def shard_range(self, group: int, shard: int) -> tuple[int, int]:
        """Flat positions ``[start, stop)`` of ``group`` held by ``shard`` (padding included)."""
        size = self.groups[group].shard_numel
        return shard * size, (shard + 1) * size

    def pieces(self, group: int, shard: int) -> list[Piece]:
        """The parameter elements that ``shard`` of ``group`` holds, in flat order (no padding)."""
        flat = self.groups[group]
        start, stop = self.shard_range(group, shard)
        pieces = []
        for param, offset in zip(flat.params, flat.offsets):
            first, last = max(start, offset), min(stop, offset + self.params[param].numel)
            if first < last:
                pieces.append(Piece(param, first - offset, last - offset, first - start))
        return pieces


@dataclass(frozen=True)
class Read:
    """Elements ``[begin, end)`` of flat group ``group`` in shard ``shard`` of a saved partition,
    which go to position ``offset`` of this rank's shard of group ``into`` of the current one."""

    shard: int
    group: int
    begin: int
    end: int
    into: int
    offset: int


def reshard_reads(saved: Partition, current: Partition, shard: int) -> list[Read]:
    """What shard ``shard`` of ``current`` reads from the shards of ``saved`` (the same
    parameters, grouped and sharded otherwise): runs of elements in the current shard's
    order, a run that continues the one before in both layouts merged with it.  Padding is
    read from nowhere."""
    where = {param: (group, offset) for group, flat in enumerate(saved.groups)
             for param, offset in zip(flat.params, flat.offsets)}
    reads: list[Read] = []
    for into in range(len(current.groups)):
        for piece in current.pieces(into, shard):
            group, offset = where[piece.param]
            size = saved.groups[group].shard_numel
            first, last = offset + piece.start, offset + piece.stop
            while first < last:
                source = first // size
                stop = min(last, (source + 1) * size)
                read = Read(source, group, first - source * size, stop - source * size, into,
                            piece.shard_offset + first - offset - piece.start)
                merged = _joined(reads[-1], read) if reads else None
                if merged is None:
                    reads.append(read)
                else:
                    reads[-1] = merged
                first = stop
    return reads


def _joined(previous: Read, read: Read) -> Read | None:
    """``previous`` and ``read`` as one run, where ``read`` continues it in both layouts."""
    if (previous.shard, previous.group, previous.into, previous.end) != (read.shard, read.group, read.into, read.begin):
        return None
    if previous.offset + previous.end - previous.begin != read.offset:
        return None
    return Read(read.shard, read.group, previous.begin, read.end, read.into, previous.offset)


def writers(partition: Partition) -> list[int]:
    """The shard that holds each parameter whole when the parameters are written out whole
    (``save_pretrained`` from ZeRO-3): the largest first, each to the shard that owns the
    fewest elements so far (the lowest of equals).  No shard then owns more elements than
    its own (a shard's share of every group) plus the largest parameter's."""
    owned = [0] * partition.num_shards
    owner = [0] * len(partition.params)
    for param in sorted(range(len(partition.params)), key=lambda i: (-partition.params[i].numel, i)):
        shard = min(range(partition.num_shards), key=lambda s: (owned[s], s))
        owner[param] = shard
        owned[shard] += partition.params[param].numel
    return owner


def expected_bytes(stage: int, num_params: int, world: int, *, param_bytes: int, grad_bytes: int,
                   optimizer_bytes: int) -> dict[str, float]:
    """Per-rank bytes that ZeRO's paper predicts for ``num_params`` parameters on ``world`` ranks.

    ``param_bytes``/``grad_bytes`` are bytes per element of the compute parameters and their
    gradients (2 and 2 in mixed precision); ``optimizer_bytes`` is the optimizer state per
    element, fp32 master weights included (12 for mixed-precision Adam: the paper's K).
    Stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    params, grads, state = (num_params * param_bytes, num_params * grad_bytes,
                            num_params * optimizer_bytes)
    return {"params": params / world if stage >= 3 else params,
            "grads": grads / world if stage >= 2 else grads,
            "optimizer": state / world if stage >= 1 else state}
