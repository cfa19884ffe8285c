"""A CPU fake of CUDA streams, events and NCCL, to check psrt's GPU data path without a GPU.

:func:`install` makes host memory play a GPU's: psrt's stream and event operations
(:mod:`psrt.comm.streams`) are replaced by :class:`FakeCuda`, whose streams keep vector
clocks, and the NCCL communicator's CuPy binding by one that carries the bytes at the
pointers it is given over the set's MPI communicator (:class:`FakeNcclCommunicator`).
A dispatch mode on the training thread and the engine thread records every tensor
operation against the stream current there.  Collectives still run at once, so results
are those of the host path; what the fake checks is the order a GPU would see:

* ``host_waits``: every time the host blocked on the GPU (``host_wait``), with its reason;
* ``unready``: a collective reading or writing memory whose last use by another stream it
  was not ordered after (its producer's ready event was not waited for);
* ``unwaited``: an operation touching memory that another stream wrote (or still reads)
  without its stream having waited for that (a consumer did not wait for the done event);
* ``early_frees``: memory a collective used freed before the stream it was freed on had
  waited for the collective.

What it cannot see: implicit synchronisations (``.item()``, ``.cpu()`` of a device tensor),
since every host tensor is a "device" tensor here; the GPU check runs under
``torch.cuda.set_sync_debug_mode("error")`` for those.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from psrt.comm import nccl, streams

from fake_nccl import FakeNcclCommunicator, FakeNcclModule

class FakeStream:
    """A stream: its clock (one tick per operation given to it) and the clocks of the other
    streams it has waited for."""

    _ids = itertools.count(1)

    def __init__(self, name: str) -> None:
        self.name, self.cuda_stream = name, next(self._ids)
        self.clock = 0
        self.seen: dict[int, int] = {}

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def after(self, stream: FakeStream, clock: int) -> bool:
        """Whether this stream is ordered after ``stream``'s operation number ``clock``."""
        return stream is self or self.seen.get(stream.cuda_stream, 0) >= clock

    def __repr__(self) -> str:
        return f"stream {self.name!r}"


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.clock, self.seen = stream, stream.clock, dict(stream.seen)


class Use:
    """One operation's use of a byte range: on which stream, at which tick, reading or writing."""

    __slots__ = ("lo", "hi", "stream", "clock", "write", "what")

    def __init__(self, lo, hi, stream, clock, write, what) -> None:
        self.lo, self.hi, self.stream, self.clock, self.write, self.what = lo, hi, stream, clock, write, what

    def overlaps(self, lo: int, hi: int) -> bool:
        return self.lo < hi and lo < self.hi


class FakeCuda(streams.CudaApi):
    """psrt's stream operations over :class:`FakeStream` s; host memory is the device's."""

    def __init__(self) -> None:
        super().__init__()
        self.compute = FakeStream("compute")
        self._local = threading.local()
        self._lock = threading.RLock()
        self.host_waits: list[str] = []
        self.unready: list[str] = []
        self.unwaited: list[str] = []
        self.early_frees: list[str] = []
        self.collectives: list[tuple[str, FakeStream, list[Use]]] = []
        self._uses: dict[FakeStream, dict[tuple, Use]] = {}  # per stream, the last read and write of each range
        self._watched: set[int] = set()

    # -- the API psrt calls ------------------------------------------------------------------
    def available(self) -> bool:
        return True

    def covers(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def identity(self, device: torch.device) -> tuple[str, str]:
        return "fake", str(os.getpid())  # one device per process: NCCL, never host staging

    def index(self, device: torch.device) -> int:
        return 0

    def current(self, device: torch.device) -> FakeStream:
        return getattr(self._local, "stream", None) or self.compute

    def new_stream(self, device: torch.device) -> FakeStream:
        return FakeStream(f"communication {next(FakeStream._ids)}")

    def record(self, stream: FakeStream) -> FakeEvent:
        with self._lock:
            return FakeEvent(stream)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        with self._lock:
            for key, clock in (*event.seen.items(), (event.stream.cuda_stream, event.clock)):
                if stream.seen.get(key, 0) < clock:
                    stream.seen[key] = clock

    def query(self, event: FakeEvent) -> bool:
        return True

    @contextlib.contextmanager
    def using(self, stream: FakeStream) -> Iterator[None]:
        previous, self._local.stream = getattr(self._local, "stream", None), stream
        try:
            yield
        finally:
            self._local.stream = previous

    def on_device(self, device: torch.device):
        return contextlib.nullcontext()

    def future(self, device: torch.device, event: FakeEvent, value: object) -> torch.futures.Future:
        """A host memory future cannot make its waiter's stream wait (torch's CUDA future does, in
        C++ that the fake cannot see), so the stream current when it is made waits at once: the
        one that asked for it, DDP's reducer's right after its all-reduce."""
        self.wait(self.current(device), event)
        future = torch.futures.Future()
        future.set_result(value)
        return future

    def host_wait(self, event: FakeEvent, why: str) -> None:
        self.host_waits.append(why)

    def host_wait_stream(self, stream: FakeStream, why: str) -> None:
        self.host_waits.append(why)

    # -- what operations did -------------------------------------------------------------------
    def touched(self, ranges: list[tuple[int, int, bool]], what: str) -> None:
        """A tensor operation on the calling thread's current stream used ``ranges``."""
        with self._lock:
            stream = self.current(torch.device("cpu"))
            self._check(stream, ranges, what, self.unwaited)
            self._add(stream, ranges, what)

    def collective(self, what: str, stream_id: int, ranges: list[tuple[int, int, bool]]) -> None:
        """A collective enqueued on stream ``stream_id`` uses ``ranges`` of host memory."""
        with self._lock:
            stream = self._stream(stream_id)
            self._check(stream, ranges, what, self.unready)
            self.collectives.append((what, stream, self._add(stream, ranges, what)))

    def _check(self, stream: FakeStream, ranges, what: str, found: list[str]) -> None:
        """Whatever another stream did to these ranges must be ordered before ``stream``
        (two reads need no order)."""
        for other, uses in self._uses.items():
            if other is stream:
                continue
            for use in uses.values():
                for lo, hi, write in ranges:
                    if (write or use.write) and use.overlaps(lo, hi) and not stream.after(use.stream, use.clock):
                        found.append(f"{what} on {stream} used memory that {use.what} on {use.stream} "
                                     f"{'wrote' if use.write else 'read'}, without waiting for it")
                        break

    def _add(self, stream: FakeStream, ranges, what: str) -> list[Use]:
        clock = stream.tick()
        uses = self._uses.setdefault(stream, {})
        added = [Use(lo, hi, stream, clock, write, what) for lo, hi, write in ranges]
        for use in added:
            uses[(use.lo, use.hi, use.write)] = use
        return added

    def freed(self, lo: int, hi: int, stream: FakeStream) -> None:
        """Memory at ``[lo, hi)``, allocated on ``stream``, went back to the allocator: a GPU's
        caching allocator hands it to the next kernel of that stream."""
        with self._lock:
            for other, uses in self._uses.items():
                for key, use in list(uses.items()):
                    if use.overlaps(lo, hi):
                        if other is not stream and not stream.after(use.stream, use.clock):
                            self.early_frees.append(f"memory {use.what} used on {use.stream} was freed on "
                                                    f"{stream} before that stream waited for it")
                        del uses[key]

    def watch(self, tensor: torch.Tensor) -> None:
        """Report the tensor's storage to :meth:`freed` when it dies (allocated on the current
        stream)."""
        storage = tensor.untyped_storage()
        lo = storage.data_ptr()
        if lo and lo not in self._watched:
            self._watched.add(lo)
            weakref.finalize(storage, self._storage_died, lo, lo + storage.nbytes(),
                             self.current(tensor.device))

    def _storage_died(self, lo: int, hi: int, stream: FakeStream) -> None:
        self._watched.discard(lo)
        self.freed(lo, hi, stream)

    @property
    def quiet(self) -> bool:
        return getattr(self._local, "quiet", False)

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """The fake's own tensor operations (the collectives' bytes over MPI) go unrecorded."""
        self._local.quiet = True
        try:
            yield
        finally:
            self._local.quiet = False

    def _stream(self, stream_id: int) -> FakeStream:
        stream = self.current(torch.device("cpu"))
        if stream.cuda_stream != stream_id:
            raise AssertionError(f"a collective was given stream {stream_id}, not the current {stream}")
        return stream

    def problems(self) -> list[str]:
        return (["host waited: " + why for why in self.host_waits] + self.unready + self.unwaited
                + self.early_frees)

    def clear(self) -> None:
        with self._lock:
            for found in (self.host_waits, self.unready, self.unwaited, self.early_frees, self.collectives):
                found.clear()


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes a (possibly strided) tensor covers."""
    if tensor.numel() == 0:
        return 0, 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    lo = tensor.data_ptr()
    return lo, lo + extent * tensor.element_size()


class Recorder(TorchDispatchMode):
    """Tells the fake which memory each tensor operation reads and writes."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.cuda.quiet:
            return out
        writes = _writes(func)
        ranges = []
        for name, value in [*zip(_names(func), args), *kwargs.items()]:
            for tensor in tree_flatten(value)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not tensor.is_sparse:
                    lo, hi = _span(tensor)
                    if hi > lo:
                        ranges.append((lo, hi, name in writes))
        if not _aliases(func):  # a view or an in-place result writes nothing new
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not tensor.is_sparse:
                    lo, hi = _span(tensor)
                    if hi > lo:
                        ranges.append((lo, hi, True))
                        self.cuda.watch(tensor)
        if ranges:
            self.cuda.touched(ranges, str(func))
        return out


def _names(func) -> list[str]:
    return [argument.name for argument in func._schema.arguments]


def _aliases(func) -> bool:
    return any(value.alias_info is not None for value in func._schema.returns)


def _writes(func) -> set[str]:
    return {argument.name for argument in func._schema.arguments
            if argument.alias_info is not None and argument.alias_info.is_write}


@contextlib.contextmanager
def install() -> Iterator[FakeCuda]:
    """Host memory as a GPU's for psrt (see the module's docstring), for a block that
    includes ``init()`` (the engine thread records from its start)."""
    from psrt.engine import engine as engine_module

    cuda = FakeCuda()
    binding = FakeNcclModule()

    def raw_communicator(host, device):
        comm = FakeNcclCommunicator(cuda, host)
        binding.communicators.append(comm)
        return comm

    original_run = engine_module.Engine._run

    def recorded_run(self) -> None:
        with Recorder(cuda):  # a mode is the thread's own
            original_run(self)

    saved = (nccl._nccl, nccl._raw_communicator)
    nccl._nccl, nccl._raw_communicator = binding, raw_communicator
    engine_module.Engine._run = recorded_run
    try:
        with streams.installed(cuda), Recorder(cuda):
            yield cuda
    finally:
        nccl._nccl, nccl._raw_communicator = saved
        engine_module.Engine._run = original_run
