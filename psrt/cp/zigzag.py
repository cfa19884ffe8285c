"""Zig-zag placement of a sequence over a context-parallel (CP) group.

The sequence is cut into 2·c chunks and rank i keeps chunks i and 2c − 1 − i.  Under a
causal mask a query attends to the keys before it, so early chunks do little work and
late chunks a lot; pairing the i-th earliest with the i-th latest gives every rank the
same amount (Megatron-LM's and the Ultra-Scale Playbook's load balancing).
"""
from __future__ import annotations

import torch

from psrt.errors import InvalidArgumentError


def check_length(length: int, size: int) -> None:
    """A sequence of ``length`` tokens must cut into 2 × ``size`` equal chunks."""
    if length % (2 * size):
        raise InvalidArgumentError(
            f"a sequence of {length} tokens does not split over context-parallel size {size}: zig-zag placement "
            f"cuts it into 2 × {size} = {2 * size} equal chunks, so its length must be a multiple of {2 * size}")


def chunks_of(rank: int, size: int) -> tuple[int, int]:
    """The two chunks (of 2 × ``size``) that ``rank`` keeps."""
    return rank, 2 * size - 1 - rank


def split(tensor: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    """``rank``'s part of a whole sequence laid along ``dim``: its two chunks, concatenated."""
    check_length(tensor.shape[dim], size)
    pieces = tensor.chunk(2 * size, dim)
    first, second = chunks_of(rank, size)
    return torch.cat([pieces[first], pieces[second]], dim)


def unsplit(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's part (in rank order): the inverse of :func:`split`."""
    size = len(parts)
    pieces: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, part in enumerate(parts):
        first, second = chunks_of(rank, size)
        pieces[first], pieces[second] = part.chunk(2, dim)
    return torch.cat(pieces, dim)


def positions(length: int, rank: int, size: int, device=None) -> torch.Tensor:
    """The positions in the whole sequence of ``rank``'s tokens, in its local order."""
    return split(torch.arange(length, device=device), 0, rank, size)
