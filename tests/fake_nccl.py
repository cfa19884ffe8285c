"""The fake device's NCCL (see ``fake_device.py``): CuPy's ``cupy.cuda.nccl`` as psrt uses it,
over host memory.  Each call tells the fake which memory it uses on which stream, then carries
the bytes at its pointers over the set's MPI communicator at once."""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import TYPE_CHECKING

import torch

from psrt.comm.base import ElementwiseOp

if TYPE_CHECKING:
    from fake_device import FakeCuda

_DTYPES = {0: torch.int8, 1: torch.uint8, 2: torch.int32, 4: torch.int64, 6: torch.float16,
           7: torch.float32, 8: torch.float64, 9: torch.bfloat16}
_OPS = {0: ElementwiseOp.SUM, 1: ElementwiseOp.PRODUCT, 2: ElementwiseOp.MAX, 3: ElementwiseOp.MIN}


class FakeNcclCommunicator:
    """CuPy's ``NcclCommunicator`` over host memory: each call carries the bytes at its pointers
    over the set's MPI communicator, and tells the fake which memory it used on which stream.
    Sends and receives complete when their thread's group ends (each thread's own: the engine
    thread's groups never finish the training thread's), on a tag of their own (the highest),
    apart from the headers psrt sends on the same communicator."""

    def __init__(self, cuda: FakeCuda, host) -> None:
        self.cuda, self.host = cuda, host
        self._pending: dict[int, list] = {}  # by thread
        self._tag = host.max_tag

    @staticmethod
    def _view(ptr: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        if count == 0:
            return torch.empty(0, dtype=dtype)
        nbytes = count * dtype.itemsize
        return torch.frombuffer((ctypes.c_byte * nbytes).from_address(ptr), dtype=torch.uint8).view(dtype)

    def _use(self, what, stream, *ranges) -> contextlib.AbstractContextManager:
        """Tell the fake what the collective uses; the block carrying its bytes goes unrecorded."""
        self.cuda.collective(what, stream, [(ptr, ptr + nbytes, write) for ptr, nbytes, write in ranges])
        return self.cuda.unrecorded()

    def allReduce(self, send, recv, count, dtype, op, stream) -> None:
        dtype = _DTYPES[dtype]
        with self._use("allreduce", stream, (send, count * dtype.itemsize, False),
                       (recv, count * dtype.itemsize, True)):
            view = self._view(recv, count, dtype)
            if send != recv:
                view.copy_(self._view(send, count, dtype))
            self.host.allreduce(view, _OPS[op])

    def reduceScatter(self, send, recv, count, dtype, op, stream) -> None:
        dtype = _DTYPES[dtype]
        size = self.host.size
        with self._use("reducescatter", stream, (send, size * count * dtype.itemsize, False),
                       (recv, count * dtype.itemsize, True)):
            self.host.reduce_scatter(self._view(send, size * count, dtype), self._view(recv, count, dtype),
                                     [count] * size, _OPS[op]).wait()

    def allGather(self, send, recv, nbytes, dtype, stream) -> None:
        size = self.host.size
        with self._use("allgather", stream, (send, nbytes, False), (recv, size * nbytes, True)):
            self.host.allgatherv(self._view(send, nbytes, torch.uint8),
                                 self._view(recv, size * nbytes, torch.uint8), [nbytes] * size).wait()

    def broadcast(self, send, recv, nbytes, dtype, root, stream) -> None:
        with self._use("broadcast", stream, (recv, nbytes, True)):
            view = self._view(recv, nbytes, torch.uint8)
            if self.host.rank == root and send != recv:
                view.copy_(self._view(send, nbytes, torch.uint8))
            self.host.broadcast(view, root).wait()

    def send(self, ptr, nbytes, dtype, peer, stream) -> None:
        with self._use(f"send to {peer}", stream, (ptr, nbytes, False)):
            request = self.host.isend(self._view(ptr, nbytes, torch.uint8).clone(), peer, self._tag)
            self._pending.setdefault(threading.get_ident(), []).append(request)

    def recv(self, ptr, nbytes, dtype, peer, stream) -> None:
        with self._use(f"receive from {peer}", stream, (ptr, nbytes, True)):
            request = self.host.irecv(self._view(ptr, nbytes, torch.uint8), peer, self._tag)
            self._pending.setdefault(threading.get_ident(), []).append(request)

    def finish_group(self) -> None:
        pending = self._pending.pop(threading.get_ident(), [])
        with self.cuda.unrecorded():
            for request in pending:
                request.wait()

    def destroy(self) -> None:
        pass


class FakeNcclModule:
    """What psrt uses of ``cupy.cuda.nccl``: constants, groups, errors."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 0, 1, 2, 4
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3

    class NcclError(RuntimeError):
        pass

    def __init__(self) -> None:
        self.communicators: list[FakeNcclCommunicator] = []

    def groupStart(self) -> None:  # noqa: N802 (CuPy's names)
        pass

    def groupEnd(self) -> None:  # noqa: N802
        for comm in self.communicators:
            comm.finish_group()
