"""One block of a tensor read from a safetensors file, without mapping the file.

``safetensors``' own reader maps the whole file into memory; the pages a slice touches then
count in the rank's resident memory beside the copy it returns (and a block of columns
touches every page of its tensor).  A rank loading its shards of a large checkpoint should
hold its shards and nothing more, so this reader takes the file's header (an 8-byte length,
then JSON giving each tensor's dtype, shape and byte range, as the format specifies) and
reads each row segment of the block straight into the destination tensor.
"""
from __future__ import annotations

import json
import math
import os

import torch

from psrt.errors import InvalidArgumentError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


class SafetensorsFile:
    """An open safetensors file: its tensors' names, dtypes and shapes, and reads of blocks."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            length = int.from_bytes(os.pread(self._fd, 8, 0), "little")
            header = json.loads(os.pread(self._fd, length, 8))
        except (ValueError, OSError) as exc:
            os.close(self._fd)
            raise InvalidArgumentError(f"{path} is not a safetensors file: {exc}") from None
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        self._data = 8 + length

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self.entries[name]["dtype"]
        if code not in DTYPES:
            raise InvalidArgumentError(f"{self.path}: {name} has dtype {code}, which psrt does not read")
        return DTYPES[code]

    def nbytes(self, name: str) -> int:
        begin, end = self.entries[name]["data_offsets"]
        return end - begin

    def read(self, name: str, dim: int = 0, begin: int = 0, end: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[begin, end)`` of dimension ``dim`` of tensor ``name`` (all of it by default),
        into ``out`` when given (contiguous, of the block's shape and the file's dtype)."""
        shape, dtype = self.shape(name), self.dtype(name)
        end = shape[dim] if shape and end is None else end
        block = (*shape[:dim], end - begin, *shape[dim + 1:]) if shape else ()
        if out is None:
            out = torch.empty(block, dtype=dtype)
        if tuple(out.shape) != block or out.dtype != dtype or not out.is_contiguous():
            raise InvalidArgumentError(f"{name}: cannot read a block of shape {block} ({dtype}) into a tensor of "
                                       f"shape {tuple(out.shape)} ({out.dtype})")
        size = dtype.itemsize
        inner = math.prod(shape[dim + 1:]) * size if shape else size
        outer = math.prod(shape[:dim]) if shape else 1
        segment, stride = (end - begin) * inner if shape else size, shape[dim] * inner if shape else size
        start = self._data + self.entries[name]["data_offsets"][0] + begin * inner
        target = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        for row in range(outer):
            self._read_into(target[row * segment:(row + 1) * segment], start + row * stride)
        return out

    def _read_into(self, view: memoryview, offset: int) -> None:
        while len(view):
            got = os.preadv(self._fd, [view], offset)
            if got <= 0:
                raise InvalidArgumentError(f"{self.path} ends before the tensor data its header promises")
            view, offset = view[got:], offset + got
