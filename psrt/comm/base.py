"""The transport interface every backend implements.

A :class:`Communicator` moves the bytes of flat, contiguous tensors between
the ranks of one group.  Higher layers (the torch API, and later the engine,
parameter server, ZeRO, TP and PP) see only this interface, so the MPI backend
for host tensors and the NCCL backend for CUDA tensors are interchangeable.

Callers guarantee what MPI requires of them: every rank of the group calls
the same collectives in the same order with matching sizes (the torch API
checks this before calling), buffers are contiguous and stay alive until the
returned :class:`Request` completes.  Tensors may have any shape; they are
treated as flat arrays of their elements.
"""
from __future__ import annotations

import abc
import enum
from typing import Callable, Sequence

import torch


#: ``irecv``'s source for a message from any rank of the group.
ANY_SOURCE = -1


class ElementwiseOp(enum.Enum):
    """Element-wise reductions every backend supports."""

    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


class Request(abc.ABC):
    """Handle of a non-blocking transport operation."""

    @abc.abstractmethod
    def test(self) -> bool:
        """True once the operation has completed (and its output is in place)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the operation has completed."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Withdraw the operation if it has not completed (a receive that may never be
        matched, at shutdown), then wait for it."""


class CompletedRequest(Request):
    """A request whose work was already done when it was created."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def cancel(self) -> None:
        return None  # nothing left to withdraw


class Communicator(abc.ABC):
    """A group of ranks and the collectives and messages between them.

    Counts are in elements of the tensors passed.  ``split`` returns a new
    communicator for a sub-group (``None`` on ranks that are not in it); it is
    collective over this communicator.
    """

    rank: int
    size: int
    # Largest message tag the backend accepts (MPI guarantees at least 32767).
    max_tag: int = 32767

    # -- collectives -------------------------------------------------------
    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> None:
        """Reduce ``tensor`` over the group, in place, then multiply it by ``scale``.

        ``scale`` (for Average and post-scaling of floating-point tensors) is
        folded into the reduction where the backend can, saving a pass over
        memory.
        """

    def allreduce_at(self, tensor: torch.Tensor, op: ElementwiseOp) -> Callable[[torch.Tensor, float], None] | None:
        """:meth:`allreduce` prepared for a tensor at ``tensor``'s address, called again and
        again (``run(buffer, scale)``, ``buffer`` lying where ``tensor`` lies), or None where
        the backend prepares nothing (then call :meth:`allreduce`)."""
        return None

    @abc.abstractmethod
    def iallreduce(self, tensor: torch.Tensor, op: ElementwiseOp, scale: float = 1.0) -> Request:
        """Non-blocking :meth:`allreduce`."""

    def persistent_allreduce(self, tensor: torch.Tensor, op: ElementwiseOp) -> "Persistent":
        """The same in-place allreduce of ``tensor``, to be started again and again (MPI's
        persistent collectives set it up once).  Collective: every rank makes it at the
        same point, as a collective call."""
        return Persistent(lambda: self.iallreduce(tensor, op))

    @abc.abstractmethod
    def allgatherv(self, send: torch.Tensor, recv: torch.Tensor,
                   counts: Sequence[int]) -> Request:
        """Concatenate every rank's ``send`` (``counts[r]`` elements) into ``recv``."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> Request:
        """Copy ``root``'s ``tensor`` into everyone's ``tensor``."""

    @abc.abstractmethod
    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int],
                  recv: torch.Tensor, recv_counts: Sequence[int]) -> Request:
        """Send ``send_counts[r]`` consecutive elements to rank r; receive likewise."""

    @abc.abstractmethod
    def reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor,
                       counts: Sequence[int], op: ElementwiseOp) -> Request:
        """Reduce ``send`` over the group; rank r keeps block r (``counts[r]`` elements)."""

    @abc.abstractmethod
    def barrier(self) -> Request:
        """Complete once every rank of the group has entered the barrier."""

    # -- point to point ----------------------------------------------------
    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Request:
        """Start sending ``tensor`` to ``dest``."""

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Request:
        """Start receiving into ``tensor`` from ``source`` (or :data:`ANY_SOURCE`)."""

    def persistent_recv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> "Persistent":
        """The same receive into ``tensor`` from ``source``, to be started again and again
        (MPI's persistent receives set it up once: a loop that re-posts one per message)."""
        return Persistent(lambda: self.irecv(tensor, source, tag))

    def isendrecv(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
                  tag: int = 0) -> Request:
        """Start sending each ``(tensor, dest)`` of ``sends`` and receiving into each ``(tensor,
        source)`` of ``recvs``, together: a backend whose sends block until their receiver takes
        them (NCCL) issues them as one group, so that two ranks sending to each other never wait
        for a receive queued behind their own send.  Messages to one peer keep their order."""
        return all_of([self.isend(t, dest, tag) for t, dest in sends] + [self.irecv(t, source, tag) for t, source in recvs])

    def send(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> None:
        self.isend(tensor, dest, tag).wait()

    def recv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> None:
        self.irecv(tensor, source, tag).wait()

    # -- small metadata and groups -------------------------------------------
    @abc.abstractmethod
    def exchange_counts(self, counts: Sequence[int]) -> list[int]:
        """Send ``counts[r]`` to rank r; return the count every rank sent to the caller.

        The size negotiation of allgather and alltoall (metadata, on the host).
        """

    @abc.abstractmethod
    def allgather_object(self, obj: object) -> list:
        """Gather one small picklable object per rank (metadata, never tensor data)."""

    @abc.abstractmethod
    def split(self, color: int | None, key: int = 0) -> "Communicator | None":
        """Sub-communicator of the ranks passing the same ``color`` (None: not included)."""

    @abc.abstractmethod
    def free(self) -> None:
        """Release the backend resources of this communicator."""


class Persistent:
    """An operation set up once and started many times; each start returns the request
    to wait on, and a start may follow only once the previous one completed.  ``run()``
    starts it and waits, for a caller with nothing to do meanwhile (a backend may do that
    in one blocking call)."""

    def __init__(self, start: Callable[[], Request]) -> None:
        self.start = start

    def run(self) -> None:
        """Start the operation and return once it has completed."""
        self.start().wait()

    def free(self) -> None:
        """Release the operation (not while a start is under way)."""


def all_of(requests: Sequence[Request]) -> Request:
    """A request that completes when every one of ``requests`` has (at once if none)."""
    return _AllOf(requests) if requests else CompletedRequest()


class _AllOf(Request):
    def __init__(self, requests: Sequence[Request]) -> None:
        self._requests = list(requests)

    def test(self) -> bool:
        return all([r.test() for r in self._requests])  # test all: each may progress

    def wait(self) -> None:
        for request in self._requests:
            request.wait()

    def cancel(self) -> None:
        for request in self._requests:
            request.cancel()


def then(request: Request, on_complete: Callable[[], None]) -> Request:
    """A request that runs ``on_complete`` once, right after ``request`` completes."""
    return _Chained(request, on_complete)


class _Chained(Request):
    def __init__(self, inner: Request, on_complete: Callable[[], None]) -> None:
        self._inner = inner
        self._on_complete: Callable[[], None] | None = on_complete

    def _finish(self) -> None:
        if self._on_complete is not None:
            callback, self._on_complete = self._on_complete, None
            callback()

    def test(self) -> bool:
        if self._on_complete is None:
            return True
        if self._inner.test():
            self._finish()
            return True
        return False

    def wait(self) -> None:
        self._inner.wait()
        self._finish()

    def cancel(self) -> None:
        self._on_complete = None  # withdrawn: what was to follow never runs
        self._inner.cancel()
