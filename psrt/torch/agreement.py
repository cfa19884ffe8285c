"""Cheap cross-rank agreement on a collective's arguments.

Before a collective moves data, every rank hashes what it was asked to do
(collective, dtype, shape, op, root...) and one tiny collective
(:meth:`Communicator.agree`) compares the hashes.  On disagreement every rank
learns it at the same time, gathers the descriptions, and raises the same
:class:`CollectiveMismatchError` naming the tensor, the ranks and the values,
instead of hanging or returning garbage.
"""
from __future__ import annotations

import zlib
from typing import Sequence

import torch

from psrt.comm.base import Communicator
from psrt.errors import CollectiveMismatchError

Descriptor = tuple[tuple[str, object], ...]


_signatures: dict[Descriptor, int] = {}
_SIGNATURE_MEMO_LIMIT = 4096


def signature(descriptor: Descriptor) -> int:
    """A hash of the descriptor that is the same in every process (unlike ``hash()``).

    Memoised, since a training loop repeats the same few descriptors.
    """
    value = _signatures.get(descriptor)
    if value is None:
        if len(_signatures) >= _SIGNATURE_MEMO_LIMIT:
            _signatures.clear()
        value = _signatures[descriptor] = zlib.crc32(repr(descriptor).encode())
    return value


def check_agreement(comm: Communicator, name: str | None, descriptor: Descriptor) -> None:
    """Raise on every rank of ``comm`` if any rank passed a different descriptor."""
    if not comm.agree(signature(descriptor)):
        raise_mismatch(comm, name, descriptor)


def raise_mismatch(comm: Communicator, name: str | None, descriptor: Descriptor) -> None:
    """Gather every rank's descriptor and raise the same error everywhere (collective)."""
    raise CollectiveMismatchError(describe_mismatch(name, comm.allgather_object(descriptor)))


def _shown(value: object) -> object:
    """Values as a user would write them: (2, 3) rather than torch.Size([2, 3])."""
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, tuple):
        return tuple(_shown(v) for v in value)
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return value


def describe_mismatch(name: str | None, descriptors: Sequence[Descriptor]) -> str:
    """E.g. "allreduce of tensor 'w' ...: shape differs: rank 0 has (2,); rank 1 has (3,)"."""
    fields = [{key: _shown(value) for key, value in d} for d in descriptors]
    keys = list(dict.fromkeys(k for d in descriptors for k, _ in d))
    parts = []
    for key in keys:
        values = [f.get(key) for f in fields]
        texts = [value if isinstance(value, str) else repr(value) for value in values]
        if len(set(texts)) > 1:
            groups: dict[str, list[int]] = {}
            for rank, text in enumerate(texts):
                groups.setdefault(text, []).append(rank)
            shown = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))} "
                              f"{'have' if len(r) > 1 else 'has'} {v}" for v, r in groups.items())
            parts.append(f"{key} differs: {shown}")
    collective = fields[0].get("collective", "collective")
    detail = ", ".join(parts) or "arguments differ"
    tensor = "an unnamed tensor" if name is None else f"tensor '{name}'"
    return f"{collective} of {tensor} was called with mismatched arguments: {detail}"
