"""Zero-copy views of torch host tensors as MPI buffers, and the dtype mapping.

MPI receives a numpy view sharing the tensor's memory (no ``.tolist()``, no
pickling).  float16 and bfloat16 travel as raw 16-bit words when data only
moves; MPI has no reduction for them, so the MPI communicator widens them to
float32 to reduce (exact for Min/Max, one rounding for Sum/Product).
"""
from __future__ import annotations

import itertools

import numpy as np
import torch
from mpi4py import MPI

from psrt.comm.base import ElementwiseOp
from psrt.errors import InvalidArgumentError

# dtype -> (dtype of the numpy view, MPI datatype used to move it)
_VIEWS: dict[torch.dtype, tuple[torch.dtype, MPI.Datatype]] = {
    torch.float32: (torch.float32, MPI.FLOAT),
    torch.float64: (torch.float64, MPI.DOUBLE),
    torch.float16: (torch.int16, MPI.UINT16_T),
    torch.bfloat16: (torch.int16, MPI.UINT16_T),
    torch.int8: (torch.int8, MPI.INT8_T),
    torch.uint8: (torch.uint8, MPI.UINT8_T),
    torch.int16: (torch.int16, MPI.INT16_T),
    torch.int32: (torch.int32, MPI.INT32_T),
    torch.int64: (torch.int64, MPI.INT64_T),
    torch.bool: (torch.bool, MPI.C_BOOL),
}

_MPI_DATATYPES = {dtype: datatype for dtype, (_, datatype) in _VIEWS.items()}

#: dtypes reduced after widening to float32, since MPI has no arithmetic for them.
WIDENED_FOR_REDUCTION = frozenset({torch.float16, torch.bfloat16})

SUPPORTED_DTYPES = frozenset(_VIEWS)

#: The one dtype table of psrt's messages: a dtype travels as its index here (every rank
#: runs the same psrt, so the order is the protocol).  Headers of the direct layer and of
#: parameter-server requests use it.
WIRE_DTYPES: tuple[torch.dtype, ...] = tuple(_VIEWS)
_WIRE_CODES = {dtype: code for code, dtype in enumerate(WIRE_DTYPES)}

_MPI_OPS = {ElementwiseOp.SUM: MPI.SUM, ElementwiseOp.MIN: MPI.MIN, ElementwiseOp.MAX: MPI.MAX,
            ElementwiseOp.PRODUCT: MPI.PROD}
# On booleans Min is "all", Max is "any", Product is "all"; Sum has no boolean meaning.
_MPI_BOOL_OPS = {ElementwiseOp.MIN: MPI.LAND, ElementwiseOp.MAX: MPI.LOR, ElementwiseOp.PRODUCT: MPI.LAND}

_NUMPY_UFUNCS = {ElementwiseOp.SUM: np.add, ElementwiseOp.MIN: np.minimum, ElementwiseOp.MAX: np.maximum,
                 ElementwiseOp.PRODUCT: np.multiply}
_NUMPY_BOOL_UFUNCS = {ElementwiseOp.MIN: np.logical_and, ElementwiseOp.MAX: np.logical_or,
                      ElementwiseOp.PRODUCT: np.logical_and}


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _VIEWS:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in _VIEWS))
        raise InvalidArgumentError(f"dtype {dtype} is not supported by the MPI backend; "
                                   f"supported: {names}")


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype``'s index in :data:`WIRE_DTYPES`, or -1 for a dtype no message can carry
    (still written into a header, so that a check can name it as another dtype)."""
    return _WIRE_CODES.get(dtype, -1)


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype a header names (None for -1 or a code this psrt does not know)."""
    return WIRE_DTYPES[code] if 0 <= code < len(WIRE_DTYPES) else None


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A flat numpy array sharing ``tensor``'s memory (``tensor`` must be contiguous)."""
    view_dtype, _ = _VIEWS[tensor.dtype]
    if view_dtype != tensor.dtype:
        tensor = tensor.view(view_dtype)
    return tensor.reshape(-1).numpy()


def mpi_buffer(tensor: torch.Tensor) -> list:
    """``[memory, datatype]`` buffer spec for mpi4py over ``tensor``'s own memory.

    The memory view is built from the data pointer (about 10x cheaper than a
    numpy view, which matters for small messages) and does not keep
    ``tensor`` alive: the caller must, until the operation completes.
    ``tensor`` must be contiguous.
    """
    datatype = _MPI_DATATYPES.get(tensor.dtype)
    if datatype is None:
        _check_dtype(tensor.dtype)
    return [MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes), datatype]


def mpi_buffer_v(tensor: torch.Tensor, counts: list[int]) -> list:
    """``[memory, (counts, displacements), datatype]`` spec for the vector collectives."""
    displacements = [0, *itertools.accumulate(counts[:-1])]
    memory, datatype = mpi_buffer(tensor)
    return [memory, (list(counts), displacements), datatype]


def mpi_op(op: ElementwiseOp, dtype: torch.dtype) -> MPI.Op:
    """The MPI reduction implementing ``op`` on ``dtype`` (after any widening)."""
    if dtype is torch.bool:
        if op not in _MPI_BOOL_OPS:
            raise InvalidArgumentError(f"op {op.name} is not defined for bool tensors; "
                                       "use Min (all) or Max (any)")
        return _MPI_BOOL_OPS[op]
    return _MPI_OPS[op]


def numpy_reducer(op: ElementwiseOp, dtype: torch.dtype):
    """``out = op(a, b)`` on numpy arrays (``out`` may be ``a``), for psrt's own ring."""
    ufunc = (_NUMPY_BOOL_UFUNCS if dtype == torch.bool else _NUMPY_UFUNCS)[op]

    def reduce(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        ufunc(a, b, out=out)

    return reduce


def host_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A new host tensor whose memory numpy allocated: numpy asks for transparent huge pages
    for large arrays, and MPI's single-copy transfers move such memory about twice as fast
    as torch's default allocation (measured: 4 MiB in 0.21-0.37 ms against 0.52-0.54 ms)."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype)
