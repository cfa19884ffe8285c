"""Finds waits on other ranks that no stall watchdog covers (issue 27: "no wait on a peer, from
import to exit, is unwatched").

psrt's watchdog knows only of the waits that are marked (``Watchdog.waiting``, a direct
group's marks) or that a loop publishes (a parameter server's serving loop).  Loaded into
every rank of a job (``unwatched_site/sitecustomize.py`` with ``PSRT_TEST_UNWATCHED=1``, or
``all`` to list the watched waits too), this module wraps every place where psrt's transport
can block on other ranks, as psrt's modules are imported:

* the blocking calls of :class:`psrt.comm.mpi.MpiCommunicator`: its creation (``MPI_Comm_dup``
  is collective), ``allreduce``, ``exchange_counts``, ``allgather_object``, ``split`` and
  ``split_by_host``; psrt's ring (:mod:`psrt.comm.ring`);
* the waits on requests: ``MpiRequest.wait`` (so ``Persistent.start().wait()`` and
  ``send``/``recv``), :func:`psrt.comm.poll.wait_politely`, a turn of
  :class:`psrt.comm.poll.Backoff` (the first of a wait: the engine's rounds, a server's loop);
* start-up: ``Arrivals.meet`` (``MPI_Comm_dup`` of the world, ``MPI_Waitall``);
* NCCL's host-side waits: a communicator's creation (collective), ``CudaEventRequest.wait``,
  ``barrier`` (a stream synchronisation);
* a caller waiting for an engine work it does not drive (``Work.wait`` before it is done).

A wait counts when it can block on another rank: never on a communicator of one rank (its
requests are tagged as they are made), and only the outermost one of nested waits.  It is
*watched* when the thread has an active mark on a watchdog that still runs (the runtime's,
or before ``init()`` returns the one it is building), or when it is the watchdog's own
thread (which never blocks) or a parameter server's serving loop (which publishes what it
holds).  Waits that test code makes on psrt's transport itself (the harness's reports, a
script waiting for a send it started, the transport's own tests), with no psrt frame between
but the transport's (its communicators and requests), are not psrt's and are left out.

Calls that cannot block on another rank are not wrapped: non-blocking starts, ``test``,
cancelling a receive, persistent set-up, ``MPI_Comm_free`` (local in Open MPI: measured,
rank 0 returns at once while rank 1 sleeps).

At exit (after psrt's own exit-time shutdown: the hook is registered first, so it runs last)
each rank writes to stderr ``UNWATCHED-AUDIT rank R: C waits on peers, U unwatched`` and
then, for each place an unwatched wait was made, ``UNWATCHED <n> rank R <wait> at <psrt
frames, innermost first> (called from <first frame outside psrt>) [<thread>]`` (with ``all``,
``WATCHED ...`` lines alike for the watched ones).
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import os
import sys
import threading
from collections import Counter
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PSRT = os.path.join(REPO, "psrt") + os.sep
_HERE = os.path.abspath(__file__)
_MAX_FRAMES = 8
# The transport itself (communicators and their requests), which waits for whoever calls it.
_TRANSPORT = tuple(f"psrt/comm/{name}.py:" for name in ("base", "mpi", "ring", "hierarchical", "nccl", "poll"))
ENV = "PSRT_TEST_UNWATCHED"

_watchdogs: list[Any] = []  # every psrt Watchdog made in this process
_found: Counter[str] = Counter()  # an unwatched wait's description -> how many times
_watched: Counter[str] = Counter()  # the same for watched waits, kept with PSRT_TEST_UNWATCHED=all
_keep_watched = os.environ.get(ENV) == "all"
_checked = 0
_local = threading.local()  # depth: inside a checked wait (inner waits are part of it)
_lock = threading.Lock()


# -- deciding -------------------------------------------------------------------------------------
def _marked(thread: int) -> bool:
    """Whether ``thread`` is inside a mark of a watchdog that still watches."""
    return any(dog._stacks.get(thread) for dog in list(_watchdogs) if not dog._stopping.is_set())


def _frames(frame: FrameType | None) -> tuple[list[str], str]:
    """psrt's frames from ``frame`` outwards (innermost first), and the first frame of other
    code than psrt and libraries (the user's or a test's) above the innermost of them; no
    frames when such code comes first (a test driving psrt's transport itself)."""
    inside: list[str] = []
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PSRT):
            inside.append(f"{os.path.relpath(path, REPO)}:{frame.f_lineno} ({frame.f_code.co_name})")
        elif path != _HERE and not _is_library(path):
            shown = os.path.relpath(path, REPO) if path.startswith(REPO) else path
            return inside, f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return inside, ""


def _is_library(path: str) -> bool:
    """Code that may sit between psrt's frames (the standard library, torch's autograd)."""
    return "site-packages" in path or path.startswith((sys.base_prefix, sys.prefix, "<"))


def _served_by_a_loop(frames: list[str]) -> bool:
    """The parameter server's serving loop publishes what it holds instead of marking."""
    return any(f.startswith("psrt/ps/server.py:") and f.endswith("(serve)") for f in frames)


def _check(what: str | Callable[[], str]) -> None:
    """Count a wait on peers the calling thread is about to make; note it if unwatched."""
    global _checked
    thread = threading.current_thread()
    if thread.name == "psrt-watchdog":  # the prober: non-blocking by design
        return
    frames, caller = _frames(sys._getframe(2))
    if all(f.startswith(_TRANSPORT) for f in frames):  # test code driving psrt's transport itself
        return
    with _lock:
        _checked += 1
    watched = _marked(thread.ident) or _served_by_a_loop(frames)
    if watched and not _keep_watched:
        return
    text = what() if callable(what) else what
    where = " < ".join(frames[:_MAX_FRAMES]) + (" < ..." if len(frames) > _MAX_FRAMES else "")
    with _lock:
        (_watched if watched else _found)[f"{text} at {where} (called from {caller or 'exit'}) [{thread.name}]"] += 1


def _waits(what: str | Callable[..., str], blocks: Callable[..., bool] = lambda *a, **k: True):
    """Wrap a function that may wait on peers: checked when ``blocks(*args)`` says it can
    block (outermost waits only)."""
    def wrap(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            depth = getattr(_local, "depth", 0)
            if depth == 0 and blocks(*args, **kwargs):
                _check(functools.partial(what, *args) if callable(what) else what)
            _local.depth = depth + 1
            try:
                return function(*args, **kwargs)
            finally:
                _local.depth = depth
        return wrapper
    return wrap


# -- which requests are local (made on a communicator of one rank) ---------------------------------
class _Local(str):
    """An ``MpiRequest``'s description, marking it as made on a communicator of one rank."""


def _tag_local(result: Any) -> Any:
    from psrt.comm import base, mpi

    if isinstance(result, mpi.MpiRequest):
        result._what = _Local(result._what)
    elif isinstance(result, mpi._MpiPersistent):
        _tag_local(result._started)
    elif isinstance(result, base._Chained):
        _tag_local(result._inner)
    elif isinstance(result, base._AllOf):
        for request in result._requests:
            _tag_local(request)
    elif result is not None and type(result).__name__ == "CudaEventRequest":
        result._local = True
    return result


def _is_local(request: Any) -> bool:
    from psrt.comm import base, mpi

    if isinstance(request, base.CompletedRequest):
        return True
    if isinstance(request, mpi.MpiRequest):
        return isinstance(request._what, _Local)
    if isinstance(request, base._Chained):
        return request._on_complete is None or _is_local(request._inner)
    if isinstance(request, base._AllOf):
        return all(_is_local(r) for r in request._requests)
    return bool(getattr(request, "_local", False))


def _tagging(function: Callable) -> Callable:
    """Wrap a method that starts a request on ``self``: tag it local on a communicator of one."""
    @functools.wraps(function)
    def wrapper(self, *args, **kwargs):
        result = function(self, *args, **kwargs)
        return _tag_local(result) if self.size == 1 else result
    return wrapper


# -- the patches, module by module ------------------------------------------------------------------
def _patch_mpi(module: ModuleType) -> None:
    cls = module.MpiCommunicator
    several = lambda self, *a, **k: self.size > 1
    cls.__init__ = _waits("MPI_Comm_dup (a new MpiCommunicator)",
                          lambda self, comm, *a, **k: comm.Get_size() > 1)(cls.__init__)
    for name in ("allreduce", "exchange_counts", "allgather_object", "split", "split_by_host"):
        setattr(cls, name, _waits(f"MpiCommunicator.{name}", several)(getattr(cls, name)))
    for name in ("iallreduce", "allgatherv", "broadcast", "alltoallv", "reduce_scatter", "barrier", "isend",
                 "irecv", "persistent_allreduce", "persistent_recv"):
        setattr(cls, name, _tagging(getattr(cls, name)))
    request = module.MpiRequest
    request.wait = _waits(lambda self: f"MpiRequest.wait ({self._what})",
                          lambda self: not _is_local(self))(request.wait)


def _patch_ring(module: ModuleType) -> None:
    several = lambda comm, *a, **k: comm.Get_size() > 1
    for name in ("ring_allreduce", "ring_reduce_scatter", "ring_allgather"):
        setattr(module, name, _waits(f"ring.{name}", several)(getattr(module, name)))


def _patch_poll(module: ModuleType) -> None:
    module.wait_politely = _waits(lambda request: f"wait_politely ({type(request).__name__})",
                                  lambda request: not _is_local(request))(module.wait_politely)
    # The first idle turn of a polling loop starts a wait (later turns continue it).
    module.Backoff.idle = _waits("a Backoff wait (a polling loop)", lambda self: not self._nap)(module.Backoff.idle)


def _patch_bootstrap(module: ModuleType) -> None:
    module.Arrivals.meet = _waits("Arrivals.meet (MPI_Comm_dup of the world, MPI_Waitall)",
                                  lambda self: self.size > 1)(module.Arrivals.meet)


def _patch_nccl(module: ModuleType) -> None:
    cls = module.NcclCommunicator
    cls.__init__ = _waits("NCCL communicator creation", lambda self, host, *a, **k: host.size > 1)(cls.__init__)
    cls.barrier = _waits("NcclCommunicator.barrier", lambda self: self.size > 1)(cls.barrier)
    for name in ("iallreduce", "reduce_scatter", "allgatherv", "broadcast", "alltoallv", "isend", "irecv"):
        setattr(cls, name, _tagging(getattr(cls, name)))
    event = module.CudaEventRequest
    event.wait = _waits("CudaEventRequest.wait (a host wait on a CUDA stream)",
                        lambda self: not _is_local(self))(event.wait)


def _patch_watchdog(module: ModuleType) -> None:
    made = module.Watchdog.__init__

    @functools.wraps(made)
    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        _watchdogs.append(self)
    module.Watchdog.__init__ = init


def _patch_work(module: ModuleType) -> None:
    module.Work.wait = _waits(lambda self, *a: f"Work.wait ({self.announcement.describe()})",
                              lambda self, *a: not self.done())(module.Work.wait)


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "psrt.comm.mpi": _patch_mpi, "psrt.comm.ring": _patch_ring, "psrt.comm.poll": _patch_poll,
    "psrt.comm.bootstrap": _patch_bootstrap, "psrt.comm.nccl": _patch_nccl,
    "psrt.comm.watchdog": _patch_watchdog, "psrt.engine.work": _patch_work,
}


class _Loader(importlib.abc.Loader):
    """Runs a module as its own loader would, then patches it (before anyone imports from it)."""

    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._inner, self._patch = inner, patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


# -- the report ------------------------------------------------------------------------------------
def report() -> list[str]:
    """This rank's summary lines (see the module docstring)."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")
    with _lock:
        found = sorted(_found.items())
        lines = [f"UNWATCHED-AUDIT rank {rank}: {_checked} waits on peers, {sum(_found.values())} unwatched"]
        watched = sorted(_watched.items())
    return (lines + [f"UNWATCHED {count} rank {rank} {where}" for where, count in found]
            + [f"WATCHED {count} rank {rank} {where}" for where, count in watched])


def _write_report() -> None:
    if "psrt.comm.mpi" not in sys.modules:
        return  # not a rank that ran psrt (psrun itself)
    os.write(2, "".join(line + "\n" for line in report()).encode())


def install() -> None:
    """Wrap psrt's waits as its modules are imported, and report at exit (once)."""
    if any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    already = [name for name in _PATCHES if name in sys.modules]
    if already:
        raise RuntimeError(f"unwatched.install() must run before psrt is imported ({already} already are)")
    sys.meta_path.insert(0, _Finder())
    atexit.register(_write_report)  # registered before psrt's shutdown hook: runs after it
