"""MPI implementation of :class:`Communicator` for host (CPU) tensors.

Tensors reach MPI as zero-copy views of their memory.  Allreduces and reduce-scatters go
by psrt's chunked ring (see :mod:`psrt.comm.ring`) or by MPI's own algorithms as the
tuning table in force says for their size (see :mod:`psrt.comm.tuning`; by default MPI
below ``Config.ring_threshold``, the ring from it); everything else uses MPI's own
algorithms.  A scaled allreduce (an average) is one MPI call and one pass of scaling after
it: in 1 MiB pieces, each scaled while in cache, it took 20-30 % longer on 2 ranks (1-8 MiB,
benchmarks/RESULTS.md).  Internal ring traffic runs on a duplicate of the communicator, so it
can never match a user's point-to-point message.
"""
from __future__ import annotations

import itertools
import zlib
from typing import Callable, Sequence

import numpy as np
import torch
from mpi4py import MPI

from psrt.comm import ring
from psrt.comm.tuning.table import Choice, fixed_table
from psrt.comm.base import (ANY_SOURCE, Communicator, CompletedRequest, Persistent, ElementwiseOp, Request,
                             then)
from psrt.comm.mpi_requests import MpiRequest, Translated, failure
from psrt.comm.paced import PACED_BYTES, Pace
from psrt.comm.buffers import (WIDENED_FOR_REDUCTION, as_numpy, mpi_buffer, mpi_buffer_v,
                               mpi_op, numpy_reducer)
from psrt.config import Config


# MPI 4.0 brought persistent collectives (MPI_Allreduce_init); an MPI 3.x library (Open MPI
# 4.1, still the system MPI of many clusters) lacks them, and mpi4py raises NotImplementedError.
# The version a library reports does not tell: Open MPI 5 reports MPI 3.1 and has them.  So the
# first persistent allreduce tries (collectively: every rank runs the same library) and the
# answer is kept; None until then.
PERSISTENT_COLLECTIVES: bool | None = None


def _persistent_allreduce(comm: MPI.Comm, spec: list, op: MPI.Op) -> MPI.Prequest | None:
    """MPI's persistent allreduce of ``spec``, or None where the library has none."""
    global PERSISTENT_COLLECTIVES
    if PERSISTENT_COLLECTIVES is False:
        return None
    try:
        request = comm.Allreduce_init(MPI.IN_PLACE, spec, op)
    except NotImplementedError:
        PERSISTENT_COLLECTIVES = False
        return None
    PERSISTENT_COLLECTIVES = True
    return request


def library_version() -> str:
    """The MPI library's name and version: the first line of ``MPI_Get_library_version``."""
    return MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip()


def _scale(tensor: torch.Tensor, scale: float) -> None:
    if scale != 1.0:
        tensor.mul_(scale)


class _MpiPersistent(Persistent):
    """An MPI persistent request: each start costs about a microsecond, against several
    for a fresh non-blocking call."""

    def __init__(self, request: MPI.Prequest, what: str, tensor: torch.Tensor) -> None:
        self._request = request
        self._started = MpiRequest(request, what, tensor)

    def start(self) -> Request:
        try:
            self._request.Start()
        except MPI.Exception as exc:
            raise failure(exc, self._started._what) from exc
        return self._started

    def free(self) -> None:
        self._request.Free()


class _MpiRepeatedAllreduce(Persistent):
    """One in-place allreduce of ``tensor``, again and again, its buffer spec made once.
    ``start()`` is MPI's persistent collective where the library has MPI-4's (else a fresh
    non-blocking call); ``run()`` is one blocking call, the fastest when the caller only
    waits: 1.1 µs for a few words on 2 ranks, against 1.35 for a persistent start and wait
    and several for a fresh non-blocking call."""

    def __init__(self, comm: MPI.Comm, tensor: torch.Tensor, op: ElementwiseOp, pace: Pace) -> None:
        self._comm, self._tensor = comm, tensor  # the tensor stays alive with the operation
        self._pace = pace if tensor.nbytes >= PACED_BYTES else None
        self._spec, self._op = mpi_buffer(tensor), mpi_op(op, tensor.dtype)
        self._what = f"allreduce of {tensor.numel()} {tensor.dtype} elements"
        with Translated(self._what):
            request = _persistent_allreduce(comm, self._spec, self._op)
        self._persistent = None if request is None else _MpiPersistent(request, self._what, tensor)

    def start(self) -> Request:
        if self._persistent is not None:
            return self._persistent.start()
        with Translated(self._what):
            return MpiRequest(self._comm.Iallreduce(MPI.IN_PLACE, self._spec, self._op), self._what, self._tensor)

    def run(self) -> None:
        try:
            if self._pace is None:
                self._comm.Allreduce(MPI.IN_PLACE, self._spec, self._op)
            else:
                self._pace.allreduce(self._comm, self._spec, self._op, self._what)
        except MPI.Exception as exc:
            raise failure(exc, self._what) from exc

    def free(self) -> None:
        if self._persistent is not None:
            self._persistent.free()


class MpiCommunicator(Communicator):
    """A group of MPI ranks carrying host tensors."""

    def __init__(self, comm: MPI.Comm, config: Config, choice: Choice | None = None) -> None:
        """``choice``: the tuning table in force, shared with the communicators of the same
        ranks (default: a fixed one of ``config.ring_threshold``)."""
        self._comm = comm
        self._ring_comm = comm.Dup()
        self._pace = Pace(self._ring_comm)  # the ring's messages never match its collective
        self._config = config
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.max_tag = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB))  # set on the world only
        self.choice = choice if choice is not None else Choice(fixed_table(config.ring_threshold))

    def _child(self, comm: MPI.Comm) -> MpiCommunicator:
        """A communicator made from this one: of the same ranks, it shares the tuning table."""
        same = comm.Get_size() == self.size
        return MpiCommunicator(comm, self._config, self.choice if same else None)

    # -- allreduce -----------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> None:
        nbytes = tensor.nbytes
        if self.size == 1 or not nbytes:
            _scale(tensor, scale)
            return
        dtype = tensor.dtype
        if dtype in WIDENED_FOR_REDUCTION:
            wide = tensor.float()
            self.allreduce(wide, op, scale)
            tensor.copy_(wide)
            return
        self.allreduce_by(self.choice.allreduce(nbytes), tensor, op, scale)

    def allreduce_by(self, algorithm: str, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> None:
        """:meth:`allreduce` of a non-empty tensor of a dtype MPI reduces, by ``algorithm``
        (``"mpi"`` or ``"ring"``), as the tuner measures them; every rank names the same one."""
        try:
            if algorithm == "ring":
                segment = max(1, self._config.ring_segment // tensor.element_size())
                ring.ring_allreduce(self._ring_comm, as_numpy(tensor), segment, numpy_reducer(op, tensor.dtype),
                                    scale)
                return
            if tensor.nbytes < PACED_BYTES:
                self._comm.Allreduce(MPI.IN_PLACE, mpi_buffer(tensor), mpi_op(op, tensor.dtype))
            else:
                self._pace.allreduce(self._comm, mpi_buffer(tensor), mpi_op(op, tensor.dtype),
                                     f"allreduce of {tensor.numel()} {tensor.dtype} elements")
        except MPI.Exception as exc:
            raise failure(exc, f"allreduce of {tensor.numel()} {tensor.dtype} elements") from exc
        if scale != 1.0:
            tensor.mul_(scale)

    def allreduce_at(self, tensor: torch.Tensor, op: ElementwiseOp) -> Callable[[torch.Tensor, float], None] | None:
        """A blocking allreduce of whatever tensor lies where ``tensor`` lies (the same address,
        size and dtype), scaled afterwards, with its MPI buffer and op made once: for a call
        repeated on the same memory (psrt's express path).  None where the call goes another
        way than one MPI allreduce: psrt's ring, a widened dtype, one rank, nothing to send."""
        nbytes = tensor.nbytes
        if self.size == 1 or not nbytes or tensor.dtype in WIDENED_FOR_REDUCTION \
                or self.choice.allreduce(nbytes) != "mpi":
            return None
        comm, spec, reduction = self._comm, mpi_buffer(tensor), mpi_op(op, tensor.dtype)
        what = f"allreduce of {tensor.numel()} {tensor.dtype} elements"
        pace = self._pace if nbytes >= PACED_BYTES else None

        def run(buffer: torch.Tensor, scale: float) -> None:
            try:
                if pace is None:
                    comm.Allreduce(MPI.IN_PLACE, spec, reduction)
                else:
                    pace.allreduce(comm, spec, reduction, what)
            except MPI.Exception as exc:
                raise failure(exc, what) from exc
            if scale != 1.0:
                buffer.mul_(scale)

        return run

    def iallreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> Request:
        if self.size == 1 or tensor.numel() == 0:
            _scale(tensor, scale)
            return CompletedRequest()
        if tensor.dtype in WIDENED_FOR_REDUCTION:
            wide = tensor.float()
            return then(self.iallreduce(wide, op, scale), lambda: tensor.copy_(wide))
        what = f"allreduce of {tensor.numel()} {tensor.dtype} elements"
        with Translated(what):
            request = self._comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(tensor),
                                            mpi_op(op, tensor.dtype))
        request = MpiRequest(request, what, tensor)
        return request if scale == 1.0 else then(request, lambda: _scale(tensor, scale))

    def persistent_allreduce(self, tensor: torch.Tensor, op: ElementwiseOp) -> Persistent:
        if self.size == 1 or tensor.dtype in WIDENED_FOR_REDUCTION:
            return super().persistent_allreduce(tensor, op)
        return _MpiRepeatedAllreduce(self._comm, tensor, op, self._pace)

    # -- other collectives -----------------------------------------------------
    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor,
                   counts: Sequence[int]) -> Request:
        what = f"allgather of {send.dtype} tensors"
        with Translated(what):
            request = self._comm.Iallgatherv(mpi_buffer(send), mpi_buffer_v(recv, list(counts)))
        return MpiRequest(request, what, send, recv)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Request:
        what = f"broadcast from rank {root}"
        with Translated(what):
            request = self._comm.Ibcast(mpi_buffer(tensor), root=root)
        return MpiRequest(request, what, tensor)

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int],
                  recv: torch.Tensor, recv_counts: Sequence[int]) -> Request:
        what = f"alltoall of {send.dtype} tensors"
        with Translated(what):
            request = self._comm.Ialltoallv(mpi_buffer_v(send, list(send_counts)),
                                            mpi_buffer_v(recv, list(recv_counts)))
        return MpiRequest(request, what, send, recv)

    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor,
                       counts: Sequence[int], op: ElementwiseOp) -> Request:
        if send.dtype in WIDENED_FOR_REDUCTION:
            wide_recv = torch.empty(recv.shape, dtype=torch.float32)
            inner = self.reduce_scatter(send.float(), wide_recv, counts, op)
            return then(inner, lambda: recv.copy_(wide_recv))
        algorithm = self.choice.reduce_scatter(send.nbytes) if self.size > 1 else "mpi"
        return self.reduce_scatter_by(algorithm, send, recv, counts, op)

    def reduce_scatter_by(self, algorithm: str, send: torch.Tensor, recv: torch.Tensor,
                          counts: Sequence[int], op: ElementwiseOp) -> Request:
        """:meth:`reduce_scatter` of a dtype MPI reduces, by ``algorithm`` (``"mpi"`` or
        ``"ring"``), as the tuner measures them; every rank names the same one."""
        what = f"reducescatter of {send.dtype} tensors"
        if algorithm == "ring":
            with Translated(what):
                self._ring_reduce_scatter(send, recv, counts, op)
            return CompletedRequest()
        with Translated(what):
            request = self._comm.Ireduce_scatter(mpi_buffer(send), mpi_buffer(recv),
                                                 list(counts), mpi_op(op, send.dtype))
        return MpiRequest(request, what, send, recv)

    def _ring_reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor,
                             counts: Sequence[int], op: ElementwiseOp) -> None:
        """psrt's ring, reading ``send`` without modifying it, with the blocks rotated
        so that rank r ends with block r."""
        starts = [0, *itertools.accumulate(counts[:-1])]
        blocks = [(start, start + count) for start, count in zip(starts, counts)]
        rotated = [blocks[(index - 1) % self.size] for index in range(self.size)]
        segment = max(1, self._config.ring_segment // send.element_size())
        ring.ring_reduce_scatter(self._ring_comm, as_numpy(send), rotated, segment,
                                 numpy_reducer(op, send.dtype), out=as_numpy(recv))

    def barrier(self) -> Request:
        with Translated("barrier"):
            return MpiRequest(self._comm.Ibarrier(), "barrier")

    # -- point to point ----------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Request:
        what = f"send to rank {dest} (tag {tag})"
        with Translated(what):
            request = self._comm.Isend(mpi_buffer(tensor), dest=dest, tag=tag)
        return MpiRequest(request, what, tensor)

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Request:
        what, request = self._receive(self._comm.Irecv, tensor, source, tag)
        return MpiRequest(request, what, tensor)

    def persistent_recv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Persistent:
        what, request = self._receive(self._comm.Recv_init, tensor, source, tag)
        return _MpiPersistent(request, what, tensor)

    @staticmethod
    def _receive(post, tensor: torch.Tensor, source: int, tag: int) -> tuple[str, MPI.Request]:
        """``post`` (``Irecv`` or ``Recv_init``) a receive into ``tensor``, and its description."""
        what = f"receive from rank {source} (tag {tag})"
        with Translated(what):
            return what, post(mpi_buffer(tensor), tag=tag, source=MPI.ANY_SOURCE if source == ANY_SOURCE else source)

    # -- metadata and groups -----------------------------------------------------
    def exchange_counts(self, counts: Sequence[int]) -> list[int]:
        send = np.array(counts, dtype=np.int64)
        recv = np.empty(self.size, dtype=np.int64)
        with Translated("exchange of sizes"):
            self._comm.Alltoall([send, MPI.INT64_T], [recv, MPI.INT64_T])
        return recv.tolist()

    def allgather_object(self, obj: object) -> list:
        with Translated("allgather of metadata"):
            return self._comm.allgather(obj)

    def split(self, color: int | None, key: int = 0) -> MpiCommunicator | None:
        with Translated("communicator split"):
            sub = self._comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if sub == MPI.COMM_NULL else self._child(sub)

    def subgroup(self, ranks: Sequence[int]) -> MpiCommunicator:
        """A communicator of ``ranks`` (ranks of this one; the caller among them, each
        calling with the same list) made by those ranks alone (``MPI_Comm_create_group``),
        for groups whose other ranks never take part in making them."""
        members = list(ranks)
        tag = zlib.crc32(np.array(members, dtype=np.int64).tobytes()) % (self.max_tag + 1)
        with Translated("creation of a communicator of ranks {}", members):
            group = self._comm.Get_group()
            included = group.Incl(members)
            sub = self._comm.Create_group(included, tag)
            included.Free()
            group.Free()
        return self._child(sub)

    def split_by_host(self) -> MpiCommunicator:
        """Sub-communicator of the ranks sharing this host's memory (``MPI_COMM_TYPE_SHARED``,
        not launcher variables, which Open MPI numbers differently under ``--map-by``)."""
        with Translated("communicator split by host"):
            return self._child(self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))

    def abort(self, code: int) -> None:
        """End every process of the job at once (used when one rank fails)."""
        self._comm.Abort(code)

    def free(self) -> None:
        for comm in (self._ring_comm, self._comm):
            if comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
                comm.Free()
