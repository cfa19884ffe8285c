"""Words for a collective whose ranks disagree: which tensor, which ranks, which values."""
from __future__ import annotations

from typing import Mapping

import torch

from psrt.engine.work import Descriptor


def _shown(value: object) -> object:
    """Values as a user would write them: (2, 3) rather than torch.Size([2, 3])."""
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, tuple):
        return tuple(_shown(v) for v in value)
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return value


def describe_mismatch(name: str | None, descriptors: Mapping[int, Descriptor]) -> str:
    """E.g. "allreduce of tensor 'w' ...: shape differs: rank 0 has (2,); rank 1 has (3,)".

    ``descriptors`` maps each rank that submitted the tensor to what it asked for.
    """
    fields = {rank: {key: _shown(value) for key, value in d} for rank, d in descriptors.items()}
    keys = list(dict.fromkeys(k for d in descriptors.values() for k, _ in d))
    parts = []
    for key in keys:
        texts = {rank: (lambda v: v if isinstance(v, str) else repr(v))(f.get(key))
                 for rank, f in fields.items()}
        if len(set(texts.values())) > 1:
            groups: dict[str, list[int]] = {}
            for rank, text in texts.items():
                groups.setdefault(text, []).append(rank)
            shown = "; ".join(f"rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))} "
                              f"{'have' if len(r) > 1 else 'has'} {v}" for v, r in groups.items())
            parts.append(f"{key} differs: {shown}")
    collectives = {f.get("collective", "collective") for f in fields.values()}
    collective = next(iter(collectives)) if len(collectives) == 1 else "collective"
    detail = ", ".join(parts) or "arguments differ"
    tensor = "an unnamed tensor" if name is None else f"tensor '{name}'"
    return f"{collective} of {tensor} was called with mismatched arguments: {detail}"
