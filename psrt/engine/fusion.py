"""Tensor fusion: allreduces that are ready together travel as one message.

The plan (which works share a message, in which order) depends only on what
every rank negotiated — sizes, dtypes, ops, the response order — so it is the
same on every rank.  How a rank lays a batch out in memory is its own affair:
if the batch's buffers already sit back to back in one storage (gradients kept
as views of a flat bucket), the message is that span and nothing is copied;
otherwise they are packed into a persistent fusion buffer and unpacked after.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from psrt.engine.negotiation import Response


@dataclass
class Batch:
    """Responses executed together: one fused allreduce, or a single other operation."""

    responses: list[Response]

    @property
    def fused(self) -> bool:
        first = self.responses[0].announcement
        return first.reduction is not None and self.responses[0].error is None


def _nbytes(response: Response) -> int:
    reduction = response.announcement.reduction
    return reduction.numel * reduction.dtype.itemsize


def plan(responses: Sequence[Response], threshold: int) -> list[Batch]:
    """Group compatible allreduces (equal fusion key) up to ``threshold`` bytes each;
    everything else runs alone.  Batches run in the order of their first response."""
    batches: list[Batch] = []
    open_batches: dict[tuple, tuple[Batch, int]] = {}
    for response in responses:
        reduction = response.announcement.reduction
        if reduction is None or response.error is not None:
            batches.append(Batch([response]))
            continue
        size = _nbytes(response)
        key = reduction.fusion_key
        current = open_batches.get(key)
        if current is not None and current[1] + size <= threshold:
            current[0].responses.append(response)
            open_batches[key] = (current[0], current[1] + size)
        else:
            batch = Batch([response])
            batches.append(batch)
            open_batches[key] = (batch, size)
    return batches


def contiguous_span(buffers: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A flat view covering ``buffers`` if they lie back to back, in order, in one storage."""
    first = buffers[0]
    base = first._base
    if base is None or any(b._base is not base for b in buffers):
        # Not all views of one tensor: compare storages (slower, but still exact).
        storage = first.untyped_storage().data_ptr()
        if any(b.untyped_storage().data_ptr() != storage for b in buffers):
            return None
    end = first.data_ptr()
    for buffer in buffers:
        if buffer.data_ptr() != end or not buffer.is_contiguous():
            return None
        end += buffer.numel() * buffer.element_size()
    return first.as_strided((sum(b.numel() for b in buffers),), (1,))


class FusionBuffers:
    """One growing staging buffer per (dtype, device), reused across steps."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        key = (dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel]


def pack(buffers: Sequence[torch.Tensor], staging: torch.Tensor) -> None:
    """Copy ``buffers`` into ``staging`` back to back (one call into torch)."""
    torch.cat([b.view(-1) for b in buffers], out=staging)


def unpack(staging: torch.Tensor, buffers: Sequence[torch.Tensor]) -> None:
    for buffer, piece in zip(buffers, staging.split([b.numel() for b in buffers])):
        buffer.view(-1).copy_(piece)
