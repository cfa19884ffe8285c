"""Tensor fusion: small allreduces that are ready together travel as one message.

The plan (which works form a batch, and which of a batch's buffers share a
message) depends only on what every rank negotiated — sizes, dtypes, ops, the
response order — so it is the same on every rank.  Large buffers are reduced
in place as messages of their own; runs of small ones share a message.  How a
rank lays such a message out is its own affair: if the buffers already sit back
to back in one storage (views of one flat tensor), the message is that span
and nothing is copied; otherwise they are packed into a persistent fusion
buffer and unpacked after.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from psrt.engine.negotiation import Response
from psrt.engine.work import BufferSpec


@dataclass
class Batch:
    """Responses executed together: one fused allreduce, or a single other operation."""

    responses: list[Response]

    @property
    def fused(self) -> bool:
        first = self.responses[0].announcement
        return first.reduction is not None and self.responses[0].error is None


#: A tensor at least this large travels as a message of its own, reduced where it
#: lies: packing it would cost two passes over its memory to save one message's
#: latency, which is worth it only for small tensors.
PACK_LIMIT_BYTES = 1 << 20


def _nbytes(response: Response) -> int:
    return response.announcement.reduction.nbytes


def plan(responses: Sequence[Response], threshold: int) -> list[Batch]:
    """Group compatible allreduces (same process set, device and op) up to ``threshold`` bytes;
    everything else runs alone.  Batches run in the order of their first response."""
    if len(responses) == 1:  # the common blocking call: nothing to group
        return [Batch(list(responses))]
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


def messages(pieces: Sequence[BufferSpec], pack_limit: int = PACK_LIMIT_BYTES) -> list[list[int]]:
    """Split a batch's pieces (in batch order) into messages: each large piece alone, each
    run of small ones of one dtype and scale together.  Pieces are agreed across ranks, so
    every rank splits the same way."""
    if len(pieces) == 1:
        return [[0]]
    result: list[list[int]] = []
    run: list[int] = []
    for index, piece in enumerate(pieces):
        if run and (piece.nbytes >= pack_limit or (piece.dtype, piece.scale)
                    != (pieces[run[0]].dtype, pieces[run[0]].scale)):
            result.append(run)
            run = []
        if piece.nbytes >= pack_limit:
            result.append([index])
        else:
            run.append(index)
    if run:
        result.append(run)
    return result


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


def _flat(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``buffers`` as flat tensors; a view costs about 3 µs from Python, so 1-D ones (a
    burst's biases, psrt's own flat buckets) are taken as they are."""
    return [b if b.dim() == 1 else b.view(-1) for b in buffers]


def pack(buffers: Sequence[torch.Tensor], staging: torch.Tensor) -> None:
    """Copy ``buffers`` into ``staging`` back to back (one call into torch)."""
    torch.cat(_flat(buffers), out=staging)


def unpack(staging: torch.Tensor, buffers: Sequence[torch.Tensor]) -> None:
    """Copy ``staging`` back into ``buffers`` (one call into torch, which makes no views of
    ``staging``: half the time of splitting it and copying the pieces for 64 gradients of
    16 KiB, and a third for a step's three biases)."""
    torch.split_with_sizes_copy(staging, [b.numel() for b in buffers], out=_flat(buffers))
