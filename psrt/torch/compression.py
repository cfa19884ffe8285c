"""Gradient compression for allreduce, with Horovod's names (``hvd.Compression.fp16``)."""
from __future__ import annotations

import torch

from psrt.errors import ArgumentTypeError


class NoneCompressor:
    """Send tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
        return tensor


class FP16Compressor:
    """Send floating-point tensors as float16, halving the bytes on the wire."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        if tensor.is_floating_point() and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: torch.dtype) -> torch.Tensor:
        return tensor if tensor.dtype == ctx else tensor.to(ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor


def compressor(compression: object):
    """The compressor a call asked for (``None`` means none); anything with compress and
    decompress is accepted, as in Horovod."""
    compression = Compression.none if compression is None else compression
    if not (callable(getattr(compression, "compress", None))
            and callable(getattr(compression, "decompress", None))):
        raise ArgumentTypeError(f"compression must be hvd.Compression.none, hvd.Compression.fp16 "
                                f"or provide compress/decompress, got {compression!r}")
    return compression
