"""Where a saved block of a tensor lies in the full tensor, and which rows of which saved
blocks make up a block a rank wants: the read plan of a sharded commit, as data.

A TP x PP commit (:mod:`psrt.elastic.sharded_model`) keeps each tensor as the blocks the
ranks held, each with its :class:`BlockLayout` (the full shape and the TP
:class:`~psrt.tp.sharding.Sharding`, or none for a whole tensor).  A rank of another grid
wants its own block, which may straddle several saved ones (TP 2 to TP 4 takes half of
one, TP 4 to TP 2 two of them), cut along another dimension, or hold padding rows past an
odd vocabulary.  :func:`pieces` says, without reading anything, which rows of which saved
block go where in the wanted one; the plan is computed, checked and agreed on by every
rank before a byte is read, and it is what the unit tests check.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from psrt.errors import ElasticError
from psrt.tp.sharding import Sharding, sharding_of

_SHARDING_FIELDS = ("dim", "parts", "index", "full_size", "stride")


@dataclass(frozen=True)
class Span:
    """Rows ``[begin, end)`` of the full tensor along ``dim``, held from row ``at`` of a block
    (``dim`` None: the block is the whole tensor)."""

    dim: int | None
    begin: int
    end: int
    at: int


@dataclass(frozen=True)
class BlockRead:
    """One read: rows ``[begin, end)`` of dimension ``rows[0]`` of a saved block (``rows[0]``
    None: all of it), narrowed to ``narrow`` (dim, start, length) when the blocks are cut
    along different dimensions, copied into the wanted block from row ``place`` (per dim)."""

    rows: tuple[int | None, int, int]
    narrow: tuple[int, int, int] | None
    place: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class BlockLayout:
    """A block of a tensor: ``shape`` is the full (single-process) tensor's, ``sharding`` the
    TP block held (None: the whole tensor), ``dtype`` the saved one."""

    shape: tuple[int, ...]
    sharding: Sharding | None = None
    dtype: str = "float32"

    @classmethod
    def of(cls, tensor: torch.Tensor, like: torch.Tensor | None) -> BlockLayout:
        """The layout of ``tensor``, a block laid out as the TP parameter ``like`` is (None:
        the whole tensor)."""
        sharding = None if like is None else sharding_of(like)
        shape = list(tensor.shape)
        if sharding is not None:
            sharding = dataclasses.replace(sharding, dim=sharding.dim % len(shape))
            shape[sharding.dim] = sharding.full_size
        return cls(tuple(shape), sharding, str(tensor.dtype).removeprefix("torch."))

    @property
    def block_shape(self) -> tuple[int, ...]:
        if self.sharding is None:
            return self.shape
        shape = list(self.shape)
        shape[self.sharding.dim] = self.sharding.padded_size // self.sharding.parts
        return tuple(shape)

    def spans(self) -> list[Span]:
        if self.sharding is None:
            return [Span(None, 0, 0, 0)]
        s = self.sharding
        return [Span(s.dim, begin, end, part * length)
                for part, (begin, end, length) in enumerate(s.source_ranges()) if end > begin]

    def to_json(self) -> dict:
        value: dict = {"shape": list(self.shape), "dtype": self.dtype}
        if self.sharding is not None:
            value.update(dataclasses.asdict(self.sharding))
        return value

    @classmethod
    def from_json(cls, value: object, where: str) -> BlockLayout:
        try:
            sharding = Sharding(**{key: int(value[key]) for key in _SHARDING_FIELDS}) if "dim" in value else None
            return cls(tuple(int(n) for n in value["shape"]), sharding, str(value["dtype"]))
        except (TypeError, KeyError, ValueError):
            raise ElasticError(f"the commit's layout of {where} is damaged ({value!r})") from None


def pieces(wanted: BlockLayout, saved: Sequence[BlockLayout], name: str) -> list[tuple[int, BlockRead]]:
    """The reads that fill the ``wanted`` block from the ``saved`` blocks of tensor ``name``
    (every file's, in file order), as (index into ``saved``, piece).  One whole saved copy is
    enough; otherwise the saved blocks must cover the tensor.  Raises :class:`ElasticError`
    naming the tensor when the shapes differ or blocks are missing."""
    for layout in saved:
        if layout.shape != wanted.shape:
            raise ElasticError(f"{name}: the commit holds it with full shape {list(layout.shape)}, this rank's model "
                               f"has {list(wanted.shape)}: the commit is of another model")
    sources = _covering(saved, name)
    return [(k, piece) for t in wanted.spans() for k in sources for s in saved[k].spans()
            if (piece := _overlap(t, s)) is not None]


def _covering(saved: Sequence[BlockLayout], name: str) -> list[int]:
    """The saved blocks to read from: the first whole copy, or one block per TP index."""
    whole = [k for k, layout in enumerate(saved) if layout.sharding is None]
    if whole:
        return whole[:1]
    first: dict[int, int] = {}
    for k, layout in enumerate(saved):
        first.setdefault(layout.sharding.index, k)
    splits = {(saved[k].sharding.dim, saved[k].sharding.parts, saved[k].sharding.stride) for k in first.values()}
    parts = saved[0].sharding.parts if saved else 0
    if not saved or len(splits) != 1 or sorted(first) != list(range(parts)):
        raise ElasticError(f"{name}: the commit holds blocks {sorted(first)} of {parts} (splits {sorted(splits)}), "
                           "not the whole tensor: a file of the commit is missing from its index")
    return sorted(first.values())


def _overlap(t: Span, s: Span) -> BlockRead | None:
    """The part of saved span ``s`` that wanted span ``t`` holds, or None."""
    if s.dim is None:
        if t.dim is None:
            return BlockRead((None, 0, 0), None, ())
        return BlockRead((t.dim, t.begin, t.end), None, ((t.dim, t.at),))
    rows = (s.dim, s.at, s.at + s.end - s.begin)
    if t.dim is None:
        return BlockRead(rows, None, ((s.dim, s.begin),))
    if s.dim != t.dim:  # cut along other dimensions: the saved rows, narrowed to the wanted ones
        return BlockRead(rows, (t.dim, t.begin, t.end - t.begin), ((t.dim, t.at), (s.dim, s.begin)))
    begin, end = max(t.begin, s.begin), min(t.end, s.end)
    if begin >= end:
        return None
    return BlockRead((s.dim, s.at + begin - s.begin, s.at + end - s.begin), None, ((t.dim, t.at + begin - t.begin),))


def fill(block: torch.Tensor, part: torch.Tensor, piece: BlockRead) -> None:
    """Copy ``part`` (what ``piece.rows`` read) into its place in ``block``."""
    if piece.narrow is not None:
        part = part.narrow(*piece.narrow)
    target = block
    for dim, row in piece.place:
        target = target.narrow(dim, row, part.shape[dim])
    target.copy_(part)
