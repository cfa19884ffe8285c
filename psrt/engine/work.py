"""One named operation submitted to the engine, and the handle its caller waits on.

The caller (any thread) builds a :class:`Work` with everything the engine
needs to run it — its name, its process set, a descriptor that every rank must
agree on, and either a reduction spec (allreduces, which the engine may fuse)
or an ``execute`` callable — then waits on it.  The engine thread runs it and
marks it done or failed; the caller's ``finish`` turns the result into the
collective's output on the caller's thread.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, NamedTuple

import torch

from psrt.comm import streams
from psrt.comm.base import Communicator, ElementwiseOp

Descriptor = tuple[tuple[str, object], ...]
#: Process sets are told apart by their id; names are unique within a set.
WorkKey = tuple[int, str]


class BufferSpec(NamedTuple):
    """One buffer of an allreduce: its element count, dtype, and the factor folded into its
    reduction (1/size for a floating-point Average; integers are scaled afterwards)."""

    numel: int
    dtype: torch.dtype
    scale: float

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class Reduction(NamedTuple):
    """How an allreduce's buffers are reduced; works with equal ``fusion_key`` may share a
    batch, whose pieces of equal dtype and scale may share a message.

    Plain values only (a named tuple: cheap to build on every call): it travels
    between ranks during negotiation, so that a rank that has joined can
    contribute zeros of the right sizes.
    """

    set_id: int
    device: str
    op: ElementwiseOp
    pieces: tuple[BufferSpec, ...]

    @property
    def fusion_key(self) -> tuple:
        return (self.set_id, self.device, self.op)

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.pieces)

    def zeros(self) -> list[torch.Tensor]:
        """What a rank that has joined contributes in place of the work's buffers."""
        device = torch.device(self.device)
        return [torch.zeros(p.numel, dtype=p.dtype, device=device) for p in self.pieces]


class Announcement(NamedTuple):
    """What a rank tells the others about one of its pending works."""

    key: WorkKey
    ranks: tuple[int, ...]  # world ranks of the process set
    descriptor: Descriptor
    reduction: Reduction | None
    cacheable: bool

    @property
    def name(self) -> str:
        return self.key[1]

    @property
    def collective(self) -> str:
        return dict(self.descriptor).get("collective", "collective")

    def describe(self) -> str:
        """E.g. "allreduce of tensor 'grad.w'", for messages."""
        return f"{self.collective} of tensor '{self.name}'"


class Route:
    """The engine's way for one repeated blocking allreduce of a single buffer (its scale folded
    into the reduction): made by :meth:`psrt.engine.Engine.route` and held by the caller as a
    token.  Only the engine fills it in, on first use: the response-cache entry (which never
    moves), the communicator, the watchdog's description, and the transport's call prepared for
    the buffer's address (``address``), made again when a call brings another buffer."""

    __slots__ = ("announcement", "op", "scale", "index", "comm", "describe", "address", "prepared")

    def __init__(self, announcement: Announcement) -> None:
        self.announcement = announcement
        self.op, self.scale = announcement.reduction.op, announcement.reduction.pieces[0].scale
        self.index: int | None = None
        self.comm: Communicator | None = None
        self.describe: Callable[[], str] | None = None
        self.address: int | None = None
        self.prepared: Callable[[torch.Tensor, float], None] | None = None


class StreamDependencies:
    """The stream ordering of a work on a GPU (see :mod:`psrt.comm.streams`).  ``ready`` is an
    event recorded on the producer's current stream when the work is submitted: the
    communication stream waits for it before the collective, so a tensor computed on any
    stream is complete when it is sent.  ``done`` is recorded on that stream after the
    collective: the consumer's current stream waits for it, and the host never does."""

    __slots__ = ("ready", "done")

    def __init__(self, device: torch.device) -> None:
        cuda = streams.api()
        self.ready = cuda.record(cuda.current(device))
        self.done = None

    def consume(self, device: torch.device) -> None:
        """Make the calling thread's current stream wait for the collective."""
        if self.done is not None:
            cuda = streams.api()
            cuda.wait(cuda.current(device), self.done)


class Work:
    """A submitted operation: its announcement, how to run it, and its completion state.

    ``buffers`` are the contiguous tensors an allreduce reduces in place (one, or
    a grouped call's tensors, described piece by piece in its reduction);
    ``execute(host, data)`` runs any other collective on the engine thread, given
    the set's host communicator (sizes, metadata) and the one that carries
    tensors on ``device``.  ``streams`` holds a CUDA work's stream dependencies
    (None for host tensors); its tensors stay referenced by the work (``buffers``, or the
    ``execute`` callable's) until its consumer has waited in :meth:`result`.  Waiting is the
    engine's (:meth:`psrt.engine.Engine.wait`, which runs cycles on the waiting thread); the
    work itself only records completion.
    """

    __slots__ = ("_pending", "announcement", "buffers", "cache_index", "device", "error", "execute",
                 "finish", "negotiated", "ready", "reported", "streams", "submitted", "value")

    def __init__(self, announcement: Announcement, *, device: torch.device,
                 buffers: list[torch.Tensor] | None = None,
                 execute: Callable[[Communicator, Communicator], object] | None = None,
                 finish: Callable[[object], object] | None = None) -> None:
        if (buffers is None) == (execute is None):
            raise ValueError("a work reduces a buffer or executes a callable, not both")
        self.announcement = announcement
        self.device = device
        self.buffers = buffers
        self.execute = execute
        self.finish = finish
        self.value: object = None
        self.error: BaseException | None = None
        # A lock held until completion: far cheaper to create than an Event, and the
        # caller creates one per collective.
        self._pending = threading.Lock()
        self._pending.acquire()
        # Timeline phases (perf_counter seconds); filled in by the engine.
        self.submitted = time.perf_counter()
        self.negotiated: float | None = None
        self.ready: float | None = None
        self.reported = False  # announced through the slow path: resolved by the shared table
        self.cache_index: int | None = None  # its response-cache entry, if it matched one
        self.streams: StreamDependencies | None = None

    @property
    def key(self) -> WorkKey:
        return self.announcement.key

    @property
    def name(self) -> str:
        return self.announcement.name

    # -- completion (engine thread) --------------------------------------------------
    def complete(self, value: object = None) -> None:
        self.value = value
        self._pending.release()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._pending.release()

    # -- the caller's side ------------------------------------------------------------
    def done(self) -> bool:
        return not self._pending.locked()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done (at most ``timeout`` seconds); whether it is."""
        if self._pending.acquire(timeout=-1 if timeout is None else timeout):
            self._pending.release()
            return True
        return False

    def result(self) -> object:
        """Wait, then return the output (or raise the error every rank got).  Runs no engine
        cycle: a caller that must not depend on the engine thread waits through
        :meth:`psrt.engine.Engine.wait`."""
        self.wait()
        if self.error is not None:
            raise self.error
        if self.streams is not None:
            self.streams.consume(self.device)
        return self.value if self.finish is None else self.finish(self.value)
