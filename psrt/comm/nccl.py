"""NCCL implementation of :class:`Communicator` for CUDA tensors, through CuPy.

Collectives are enqueued on the calling thread's current stream of the device
(the engine makes that a communication stream, :mod:`psrt.comm.streams`) and are
ordered with the work around them on that stream.  A request's done event is
recorded after the collective: waiting on the request makes the waiting thread's
current stream wait for that event, never the host; ``test`` asks whether it fired.  Small metadata (agreement checks,
object gathers, the NCCL unique id) travels over the MPI communicator of the
same group, which is also what creates and splits NCCL communicators.

NCCL matches point-to-point messages by call order between a pair of ranks,
not by tag: ``tag`` is accepted for interface compatibility and ignored.
"""
from __future__ import annotations

from typing import Sequence

import torch

from psrt.comm import streams
from psrt.comm.base import Communicator, ElementwiseOp, Request
from psrt.errors import CommunicationError, InvalidArgumentError, UnsupportedOperationError

try:  # CuPy is the optional ``psrt[gpu]`` extra
    from cupy.cuda import nccl as _nccl
except ImportError:  # pragma: no cover - exercised only where CuPy is installed
    _nccl = None

_NCCL_BFLOAT16 = 9  # ncclBfloat16 in nccl.h (NCCL >= 2.10); older CuPy lacks the constant


def nccl_available() -> bool:
    """True when CuPy's NCCL bindings import and torch sees a CUDA device."""
    return _nccl is not None and streams.api().available()


def _reduction_types() -> dict[torch.dtype, int]:
    return {
        torch.float16: _nccl.NCCL_FLOAT16,
        torch.bfloat16: getattr(_nccl, "NCCL_BFLOAT16", _NCCL_BFLOAT16),
        torch.float32: _nccl.NCCL_FLOAT32,
        torch.float64: _nccl.NCCL_FLOAT64,
        torch.int8: _nccl.NCCL_INT8,
        torch.uint8: _nccl.NCCL_UINT8,
        torch.int32: _nccl.NCCL_INT32,
        torch.int64: _nccl.NCCL_INT64,
        torch.bool: _nccl.NCCL_UINT8,  # 0/1 bytes: Min is "all", Max is "any", Product is "all"
    }


def _reduction_ops() -> dict[ElementwiseOp, int]:
    return {ElementwiseOp.SUM: _nccl.NCCL_SUM, ElementwiseOp.MIN: _nccl.NCCL_MIN,
            ElementwiseOp.MAX: _nccl.NCCL_MAX, ElementwiseOp.PRODUCT: _nccl.NCCL_PROD}


def _displacements(counts: Sequence[int]) -> list[int]:
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += count
    return offsets


def _raw_communicator(host: Communicator, device: torch.device):
    """CuPy's NCCL communicator over ``host``'s ranks, its unique id sent over MPI (where tests
    put a fake: ``tests/fake_device.py``)."""
    unique_id = _nccl.get_unique_id() if host.rank == 0 else None
    unique_id = host.allgather_object(unique_id)[0]
    with streams.api().on_device(device):
        return _nccl.NcclCommunicator(host.size, unique_id, host.rank)


class CudaEventRequest(Request):
    """Completes when the work enqueued before it on the current stream has finished; holds
    the tensors that work uses until then."""

    def __init__(self, device: torch.device, *keep: torch.Tensor) -> None:
        cuda = streams.api()
        self._device = device
        self._event = cuda.record(cuda.current(device))
        self._keep = keep

    def test(self) -> bool:
        return streams.api().query(self._event)

    def wait(self) -> None:
        """Make the calling thread's current stream wait for the work (the host goes on)."""
        cuda = streams.api()
        cuda.wait(cuda.current(self._device), self._event)

    def cancel(self) -> None:
        raise UnsupportedOperationError("NCCL work already enqueued on a CUDA stream cannot be withdrawn")


class NcclCommunicator(Communicator):
    """NCCL communicator over the ranks of ``host`` (an MPI communicator), on one CUDA device."""

    def __init__(self, host: Communicator, device: torch.device, owns_host: bool = False) -> None:
        if not nccl_available():
            raise CommunicationError("the NCCL backend needs CuPy (pip install psrt[gpu]) and a "
                                     "CUDA device")
        self._host = host
        self._owns_host = owns_host  # a communicator made by split() frees its MPI side too
        self._device = device
        self._types = _reduction_types()
        self._ops = _reduction_ops()
        self._comm = _raw_communicator(host, device)
        self.rank, self.size = host.rank, host.size

    def _stream(self) -> int:
        return streams.api().current(self._device).cuda_stream

    def _bytes(self, tensor: torch.Tensor) -> tuple[int, int]:
        return tensor.data_ptr(), tensor.numel() * tensor.element_size()

    def _run(self, what: str, enqueue, *keep: torch.Tensor) -> Request:
        """Enqueue NCCL calls (grouped) on the current stream; a request for their completion."""
        try:
            with streams.api().on_device(self._device):
                _nccl.groupStart()
                try:
                    enqueue(self._stream())
                finally:
                    _nccl.groupEnd()
                return CudaEventRequest(self._device, *keep)
        except _nccl.NcclError as exc:
            raise CommunicationError(f"NCCL failed during {what}: {exc}") from exc

    # -- reductions ------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> None:
        self.iallreduce(tensor, op, scale)  # stream-ordered: later work on the stream sees it

    def iallreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> Request:
        if tensor.dtype == torch.int16:  # NCCL has no 16-bit integers: reduce in int32
            wide = tensor.int()
            self.iallreduce(wide, op, scale)
            tensor.copy_(wide)
            return CudaEventRequest(self._device, tensor, wide)
        if tensor.dtype not in self._types:
            raise InvalidArgumentError(f"dtype {tensor.dtype} is not supported by the NCCL backend")
        ptr, count = tensor.data_ptr(), tensor.numel()
        nccl_type, nccl_op = self._types[tensor.dtype], self._ops[op]

        def enqueue(stream: int) -> None:
            self._comm.allReduce(ptr, ptr, count, nccl_type, nccl_op, stream)

        request = self._run("allreduce", enqueue, tensor)
        if scale != 1.0:
            tensor.mul_(scale)
            request = CudaEventRequest(self._device, tensor)
        return request

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor,
                       counts: Sequence[int], op: ElementwiseOp) -> Request:
        if send.dtype == torch.int16:
            wide_recv = torch.empty(recv.shape, dtype=torch.int32, device=recv.device)
            self.reduce_scatter(send.int(), wide_recv, counts, op)
            recv.copy_(wide_recv)
            return CudaEventRequest(self._device, recv, wide_recv)
        nccl_type, nccl_op = self._types[send.dtype], self._ops[op]
        size = send.element_size()
        send_ptr, recv_ptr = send.data_ptr(), recv.data_ptr()

        def enqueue(stream: int) -> None:
            if len(set(counts)) == 1:
                self._comm.reduceScatter(send_ptr, recv_ptr, counts[0], nccl_type, nccl_op, stream)
                return
            for root, (offset, count) in enumerate(zip(_displacements(counts), counts)):
                self._comm.reduce(send_ptr + offset * size, recv_ptr, count, nccl_type, nccl_op,
                                  root, stream)

        return self._run("reducescatter", enqueue, send, recv)

    # -- data movement (as bytes, so every dtype travels) --------------------------
    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor,
                   counts: Sequence[int]) -> Request:
        size = send.element_size()
        send_ptr, recv_ptr = send.data_ptr(), recv.data_ptr()

        def enqueue(stream: int) -> None:
            if len(set(counts)) == 1:
                self._comm.allGather(send_ptr, recv_ptr, counts[0] * size, _nccl.NCCL_INT8, stream)
                return
            for root, (offset, count) in enumerate(zip(_displacements(counts), counts)):
                self._comm.broadcast(send_ptr, recv_ptr + offset * size, count * size,
                                     _nccl.NCCL_INT8, root, stream)

        return self._run("allgather", enqueue, send, recv)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Request:
        ptr, nbytes = self._bytes(tensor)
        return self._run("broadcast", lambda stream: self._comm.broadcast(
            ptr, ptr, nbytes, _nccl.NCCL_INT8, root, stream), tensor)

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int],
                  recv: torch.Tensor, recv_counts: Sequence[int]) -> Request:
        size = send.element_size()
        send_ptr, recv_ptr = send.data_ptr(), recv.data_ptr()

        def enqueue(stream: int) -> None:
            for peer, (offset, count) in enumerate(zip(_displacements(send_counts), send_counts)):
                self._comm.send(send_ptr + offset * size, count * size, _nccl.NCCL_INT8, peer,
                                stream)
            for peer, (offset, count) in enumerate(zip(_displacements(recv_counts), recv_counts)):
                self._comm.recv(recv_ptr + offset * size, count * size, _nccl.NCCL_INT8, peer,
                                stream)

        return self._run("alltoall", enqueue, send, recv)

    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Request:
        ptr, nbytes = self._bytes(tensor)
        return self._run(f"send to rank {dest}", lambda stream: self._comm.send(
            ptr, nbytes, _nccl.NCCL_INT8, dest, stream), tensor)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Request:
        ptr, nbytes = self._bytes(tensor)
        return self._run(f"receive from rank {source}", lambda stream: self._comm.recv(
            ptr, nbytes, _nccl.NCCL_INT8, source, stream), tensor)

    # -- host-side pieces ------------------------------------------------------------
    def barrier(self) -> Request:
        cuda = streams.api()
        cuda.host_wait_stream(cuda.current(self._device), "a barrier: the host passes it once the "
                              "work queued before it has run")
        return self._host.barrier()

    def exchange_counts(self, counts: Sequence[int]) -> list[int]:
        return self._host.exchange_counts(counts)

    def allgather_object(self, obj: object) -> list:
        return self._host.allgather_object(obj)

    def split(self, color: int | None, key: int = 0) -> NcclCommunicator | None:
        host = self._host.split(color, key)
        return None if host is None else NcclCommunicator(host, self._device, owns_host=True)

    def free(self) -> None:
        self._comm.destroy()
        if self._owns_host:
            self._host.free()
