"""Cheap cross-rank agreement on a collective's arguments.

Before a collective moves data, every rank hashes what it was asked to do
(collective, dtype, shape, op, root...) and one tiny allreduce compares the
hashes: the min and max of all hashes equal one's own only if every rank
agrees.  On disagreement every rank learns it at the same time, gathers the
descriptions, and raises the same :class:`CollectiveMismatchError` naming the
tensor, the ranks and the values, instead of hanging or returning garbage.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch

from psrt.comm.base import Communicator, ReduceOp
from psrt.errors import CollectiveMismatchError

Descriptor = tuple[tuple[str, object], ...]


def signature(descriptor: Descriptor) -> int:
    """A hash of the descriptor that is the same in every process (unlike ``hash()``)."""
    return zlib.crc32(repr(descriptor).encode())


def check_agreement(comm: Communicator, name: str, descriptor: Descriptor) -> None:
    """Raise on every rank of ``comm`` if any rank passed a different descriptor."""
    if comm.size == 1:
        return
    mine = signature(descriptor)
    probe = torch.tensor([mine, -mine], dtype=torch.int64)
    comm.allreduce(probe, ReduceOp.MIN)
    if probe[0].item() == mine and -probe[1].item() == mine:
        return
    raise_mismatch(comm, name, descriptor)


def raise_mismatch(comm: Communicator, name: str, descriptor: Descriptor) -> None:
    """Gather every rank's descriptor and raise the same error everywhere (collective)."""
    raise CollectiveMismatchError(describe_mismatch(name, comm.allgather_object(descriptor)))


def describe_mismatch(name: str, descriptors: Sequence[Descriptor]) -> str:
    """E.g. "allreduce of tensor 'w' ...: shape differs: rank 0 has (2,); rank 1 has (3,)"."""
    fields = [dict(d) for d in descriptors]
    keys = list(dict.fromkeys(k for d in descriptors for k, _ in d))
    parts = []
    for key in keys:
        values = [f.get(key) for f in fields]
        if len({repr(v) for v in values}) > 1:
            groups: dict[str, list[int]] = {}
            for rank, value in enumerate(values):
                groups.setdefault(repr(value), []).append(rank)
            shown = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))} "
                              f"{'have' if len(r) > 1 else 'has'} {v}" for v, r in groups.items())
            parts.append(f"{key} differs: {shown}")
    collective = fields[0].get("collective", "collective")
    detail = ", ".join(parts) or "arguments differ"
    return f"{collective} of tensor '{name}' was called with mismatched arguments: {detail}"
