"""The one reader of safetensors files in psrt: the ``safetensors`` library's, checked as the
format requires, with blocks of a tensor read straight from the file, and naming the tensor a
refusal is about.

On opening, the library validates the header (its length bounded by the file, known dtypes,
every dtype x shape equal to its byte span, offsets inside the data, contiguous and covering
it); whole tensors are read by the library's ``pread`` backend, which reads only their bytes
(its default maps the whole file, so the pages a read touches would count in the rank's
resident memory beside the copy it returns).  A block of a tensor (a run of rows along one
dimension) is read here, with ``pread`` at the byte offsets of the validated header, straight
into the tensor returned: the library's slices read the whole tensor first (0.8: reading 1 MiB
of a 16 MiB tensor held 17 MiB), and a rank loading its shards should hold its shards and
nothing more.  This module also explains a refusal: the library's messages do not always name
the tensor, so the header is walked again in Python to find the entry at fault, and the
caller's error class gets the file and the tensor.
"""
from __future__ import annotations

import json
import math
import os

import torch
from safetensors import SafetensorError, safe_open

from psrt.errors import InvalidArgumentError, PsrtError

# Bytes per element of each dtype code the format defines that torch can hold.
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}  # the dtypes psrt reads
_HEADER_LIMIT = 100 << 20  # the library's own bound on a header


class SafetensorsReader:
    """An open safetensors file, validated: its tensors' names, dtypes and shapes, and reads
    of whole tensors or of a run of rows along one dimension.  Raises ``error`` (a psrt error
    class) naming the file, and the tensor where one is at fault."""

    def __init__(self, path: str, error: type[PsrtError] = InvalidArgumentError) -> None:
        self.path, self._error = path, error
        try:
            self._file = safe_open(path, framework="pt", backend="pread")
        except (SafetensorError, OSError) as exc:
            raise error(f"{path} is not a valid safetensors file: {diagnose(path) or exc}; nothing was read "
                        "from it") from None
        self._names = list(self._file.keys())
        self._fd: int | None = None  # for blocks, opened on the first
        self._starts: dict[str, int] = {}  # each tensor's first byte in the file

    def close(self) -> None:
        self._file.__exit__(None, None, None)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def names(self) -> list[str]:
        return list(self._names)

    def metadata(self) -> dict[str, str]:
        return self._file.metadata() or {}

    def _slice(self, name: str):
        if name not in self._names:
            raise self._error(f"{self.path} holds no tensor {name!r}")
        return self._file.get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        dtype = _TORCH_DTYPES.get(code)
        if dtype is None:
            raise self._error(f"{self.path}: tensor {name!r} has dtype {code}, which psrt does not read")
        return dtype

    def nbytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * self.dtype(name).itemsize

    def read(self, name: str, dim: int = 0, begin: int = 0, end: int | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``[begin, end)`` of dimension ``dim`` of tensor ``name`` (all of it by default);
        a block is read alone, nothing else of the tensor held.  ``out``: a contiguous host
        tensor of the block's shape and the file's dtype to read into, which is returned."""
        shape = self.shape(name)
        if not shape:  # a scalar: its one element
            return self._file.get_tensor(name) if out is None else self._block(name, shape, 0, 0, 1, out)
        end = shape[dim] if end is None else end
        if not 0 <= begin <= end <= shape[dim]:
            raise self._error(f"{self.path}: rows [{begin}, {end}) of dim {dim} are outside tensor {name!r} of "
                              f"shape {list(shape)}")
        if out is None and (begin, end) == (0, shape[dim]):
            return self._file.get_tensor(name)
        return self._block(name, shape, dim, begin, end, out)

    def _block(self, name: str, shape: tuple[int, ...], dim: int, begin: int, end: int,
               out: torch.Tensor | None) -> torch.Tensor:
        """Rows ``[begin, end)`` of dimension ``dim``: one run of bytes for each index of the
        dimensions before it, each read into its place in ``out`` (or a new tensor)."""
        dtype, block = self.dtype(name), (*shape[:dim], end - begin, *shape[dim + 1:]) if shape else ()
        if out is None:
            out = torch.empty(block, dtype=dtype)
        elif tuple(out.shape) != block or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise self._error(f"{self.path}: cannot read rows of {name!r} ({list(block)}, {dtype}) into a tensor of "
                              f"shape {list(out.shape)}, {out.dtype}, on {out.device} (contiguous: {out.is_contiguous()})")
        inner = math.prod(shape[dim + 1:]) * dtype.itemsize  # bytes of one row of ``dim``
        run, stride = (end - begin) * inner, (shape[dim] if shape else 1) * inner
        if out.numel() == 0:
            return out
        target = memoryview(out.view(-1).view(torch.uint8).numpy())
        first = self._start(name) + begin * inner
        for index in range(math.prod(shape[:dim])):
            self._read_into(target[index * run:(index + 1) * run], first + index * stride, name)
        return out

    def _start(self, name: str) -> int:
        """Where tensor ``name``'s bytes begin in the file, from the header the library
        validated (read again here: the library does not give the offsets)."""
        if not self._starts:
            with open(self.path, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length))
            self._starts = {key: 8 + length + entry["data_offsets"][0] for key, entry in header.items()
                            if key != "__metadata__"}
            self._fd = os.open(self.path, os.O_RDONLY)
        if name not in self._starts:
            raise self._error(f"{self.path} changed while it was open: tensor {name!r} is gone from its header")
        return self._starts[name]

    def _read_into(self, view: memoryview, offset: int, name: str) -> None:
        while len(view):
            got = os.preadv(self._fd, [view], offset)
            if got <= 0:
                raise self._error(f"{self.path} ends inside tensor {name!r}: it was cut short while it was open")
            view, offset = view[got:], offset + got


def diagnose(path: str) -> str | None:
    """What is wrong with the safetensors file at ``path``, naming the tensor at fault, or
    None when this walk finds nothing (the library's own message then stands)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            start = f.read(8)
            if len(start) < 8:
                return f"it has {size} bytes, fewer than the 8 that give its header's length"
            length = int.from_bytes(start, "little")
            if length > min(size - 8, _HEADER_LIMIT):
                return f"its header claims {length} bytes, but the file has {size - 8} after the length"
            header = json.loads(f.read(length))
    except OSError as exc:
        return f"it cannot be read ({exc})"
    except ValueError as exc:
        return f"its header is not valid JSON ({exc})"
    if not isinstance(header, dict):
        return f"its header is a JSON {type(header).__name__}, not an object naming each tensor"
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        fault = _entry_fault(entry)
        if fault:
            return f"tensor {name!r}: {fault}"
        spans.append((entry["data_offsets"][0], entry["data_offsets"][1], name))
    position, data = 0, size - 8 - length
    for begin, end, name in sorted(spans):
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else f"leaves bytes {position}-{begin} unused"
            return f"tensor {name!r}: its data_offsets [{begin}, {end}] {what}"
        position = end
    if position != data:
        return (f"its tensors' data ends at byte {position} of the data, which has {data} bytes (the file was cut "
                "short or extended)" if position > data else f"{data - position} bytes after the last tensor")
    return None


def _entry_fault(entry: object) -> str | None:
    if not isinstance(entry, dict):
        return f"its entry is a JSON {type(entry).__name__}, not an object"
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in entry]
    if missing:
        return f"its entry lacks {missing}"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _ITEM_BYTES:
        return f"unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return f"shape {shape!r} is not a list of sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"data_offsets {offsets!r} are not a byte range [begin, end]"
    expected = math.prod(shape) * _ITEM_BYTES[dtype]
    if offsets[1] - offsets[0] != expected:
        return (f"dtype {dtype} x shape {shape} is {expected} bytes, but its data_offsets {offsets} span "
                f"{offsets[1] - offsets[0]}")
    return None
