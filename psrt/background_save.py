"""Checkpoints written in the background: a save returns once what it saves is staged in host
memory, and a thread writes it while training goes on (torch DCP's ``async_save``).

``state.commit(background=True)`` (an elastic commit) and ``zero.save(directory,
background=True)`` hand what they save to their process set's :class:`BackgroundSaver` and
return a :class:`SaveHandle`.  The write is that of a synchronous save, run by
:func:`write_then_publish` in both: every rank writes its own files with psrt's one
checkpoint writer (:mod:`psrt.checkpoint.files`: each file fsynced, then renamed into place),
then the first rank writes the commit record the same way.  A crash at any moment before
that record is renamed into place leaves the previous commit the one a relaunch reads; a
failure on any rank fails the save on every rank, naming each rank that failed.

Staging.  The callers save copies they made for the save alone (an elastic ``save()``'s, a
ZeRO shard's clones), which nothing writes afterwards: on the host those copies are the
staged state.  CUDA tensors among them are copied to pinned host memory on a side stream of
their device that first waits for the calling stream (their producer); the calling stream
then waits for the copies, so a later write to a tensor comes after its copy, and the host
never waits: the writer thread does, before it writes (stream operations through
:func:`psrt.comm.streams.api`, which the tests' CPU fake checks).

One save in flight per process set.  The set's next save (a ZeRO save, background or not;
an elastic state's next commit) or ``wait()`` waits for it first, and raises its error there
unless its handle already did.  The outcome was agreed by every rank, so every rank raises
the same error at the same call.  ``shutdown()`` (and so the end of the script) waits for a
save in flight and raises an error nobody was told of (at exit it is printed).

Where the ranks agree.  Before the first rank writes the commit record, every rank must have
written its files, and afterwards every rank must learn whether the record was written.  That
agreement runs on the writer thread, over a communicator of the saver's own: a direct group
(:meth:`psrt.topology.Topology.direct_over`) made collectively at the set's first background
save and used by that thread alone.  The training thread's collectives (the engine's, the
direct groups') go on meanwhile over their own communicators, so the order in which the two
threads reach MPI may differ from rank to rank without harm, which one communicator shared by
both would not survive (a deadlock, or psrt's mismatch checks tripping); the writer's waits
are marked for the watchdog as any other.  Leaving the agreement and the record to the
training thread's next save or wait instead was rejected: a commit whose files were all
written would then be lost by a crash before that call, and ``wait()`` would become
collective.
"""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from psrt.checkpoint.document import map_tensors
from psrt.comm import streams
from psrt.comm.direct import DirectGroup
from psrt.errors import CheckpointError
from psrt.runtime import Runtime
from psrt.topology import ProcessSet

__all__ = ["SaveHandle"]  # what a user holds; the rest serves psrt.elastic and psrt.zero

#: What every rank passes to the others: its failure (None when all went well) and the
#: records of the files it wrote (file name -> size and sha256), given a label for the wait.
Exchange = Callable[[object, str], list]
_LABEL = "background checkpoint"
_WHY_HOST_WAIT = "a background save writes its staged copy from host memory"


def write_then_publish(write: Callable[[], dict[str, dict]], publish: Callable[[dict[str, dict]], None],
                       exchange: Exchange, rank: int) -> list[str]:
    """One save of files, then a commit record: every rank runs ``write`` (its own files;
    returns their records by file name), then, once every rank has written, rank 0 of the
    exchange runs ``publish`` with every rank's records (it writes the commit record).
    Returns what failed, naming each rank (empty when the save is whole): the same list on
    every rank.

    Collective over the ranks ``exchange`` reaches, in the same order on every one."""
    failure, records = None, {}
    try:
        records = write()
    except Exception as exc:  # every rank learns of it below
        failure = f"rank {rank}: {type(exc).__name__}: {exc}"
    outcomes = exchange((failure, records), "files")
    errors = [error for error, _ in outcomes if error]
    if not errors and rank == 0:
        try:
            publish({name: record for _, written in outcomes for name, record in written.items()})
        except Exception as exc:
            errors.append(f"rank 0: {type(exc).__name__}: {exc}")
    return exchange(errors, "outcome")[0]


class SaveHandle:
    """A background save (what ``state.commit(background=True)`` and ``zero.save(...,
    background=True)`` return), as ``async_save``'s future: :meth:`wait` (or :meth:`result`)
    blocks until its files and commit record are written and raises its error, the same on
    every rank; :meth:`done` says whether it has finished.  Waiting is not collective, but call
    it on every rank or on none: an error it raised is not raised again by the next save."""

    def __init__(self, future: concurrent.futures.Future | None) -> None:
        self._future = future  # None: nothing was left to write when the call returned
        self.told = False  # whether its error has been raised to the caller

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def error(self) -> Exception | None:
        """The save's error once it has finished (None: it is written); waits for it."""
        return None if self._future is None else self._future.result()

    def wait(self) -> None:
        """Block until the save is written; raises its error if it failed (on every rank)."""
        error = self.error()
        if error is not None:
            self.told = True
            raise error

    result = wait


class BackgroundSaver:
    """The background writer of one process set's saves (see :func:`saver_of`): one thread,
    one save at a time, agreeing over ``group``, a direct group no other thread uses."""

    def __init__(self, group: DirectGroup) -> None:
        self._group = group
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="psrt-background-save")
        self._last: SaveHandle | None = None
        self._sides: dict[int, object] = {}  # a side stream per CUDA device, for staging copies

    @property
    def rank(self) -> int:
        """This rank's place in the set (0: the one that publishes)."""
        return self._group.rank

    def stage(self, document: object) -> Staged:
        """``document`` (tensors the caller copied for this save, plain data) with its CUDA
        tensors being copied to host memory (see the module's docstring); the host is not
        held up."""
        cuda = streams.api()
        pairs: dict[int, tuple] = {}  # device index -> (its current stream, its side stream)
        kept: list[torch.Tensor] = []  # the device tensors, alive until their copies are in

        def to_host(tensor: torch.Tensor) -> torch.Tensor:
            if not cuda.covers(tensor.device):
                return tensor
            index = cuda.index(tensor.device)
            if index not in pairs:
                current, side = cuda.current(tensor.device), self._side(tensor.device, index)
                cuda.wait(side, cuda.record(current))  # the copy reads what its producer wrote
                pairs[index] = current, side
            with cuda.using(pairs[index][1]):
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
                host.copy_(tensor.detach(), non_blocking=True)
            kept.append(tensor)
            return host

        staged = map_tensors(document, to_host)
        done = []
        for current, side in pairs.values():
            done.append(cuda.record(side))
            cuda.wait(current, done[-1])  # later writes to the tensors come after their copies
        return Staged(staged, done, kept)

    def _side(self, device: torch.device, index: int):
        side = self._sides.get(index)
        if side is None:
            side = self._sides[index] = streams.api().new_stream(device)
        return side

    def submit(self, write: Callable[[], dict[str, dict]], publish: Callable[[dict[str, dict]], None],
               failed: Callable[[list[str]], Exception]) -> SaveHandle:
        """Run :func:`write_then_publish` of ``write`` and ``publish`` on the writer thread,
        after the save in flight (whose error this raises first, unless its handle did);
        ``failed`` makes the error of a save that failed from the ranks' reasons.

        Collective: every rank of the set submits the same saves in the same order."""
        self.wait()
        rank = self.rank

        def run() -> Exception | None:
            try:
                errors = write_then_publish(write, publish, self._exchange, rank)
            except Exception as exc:  # the exchange itself failed: only this rank knows
                return CheckpointError(f"the background save on rank {self._group.ranks[rank]} could not finish: "
                                       f"{type(exc).__name__}: {exc}")
            return failed(errors) if errors else None

        self._last = SaveHandle(self._thread.submit(run))
        return self._last

    def _exchange(self, value: object, what: str) -> list:
        """Every rank's ``value``, once every rank has come: the wait naps (MPI's own blocking
        calls spin, which would take a core from training while a slower rank writes)."""
        group = self._group
        me = group.ranks[group.rank]
        group.wait(group.host.barrier(), f"a {_LABEL}", lambda: f"rank {me}'s background save ({what}) over "
                   f"{group.name}, waiting for the other ranks to finish writing")
        return group.allgather_object(value, label=f"{_LABEL} ({what})")

    def wait(self) -> None:
        """Wait for the save in flight; raise its error unless its handle already did."""
        last = self._last
        if last is not None and last.error() is not None and not last.told:
            last.wait()

    def finish(self) -> str | None:
        """Wait for the save in flight and stop the thread (at shutdown); returns the error of
        a save that failed if nobody was told of it."""
        try:
            self.wait()
        except Exception as exc:
            return str(exc)
        finally:
            self._thread.shutdown(wait=True)
        return None


class Staged:
    """A staged document: its tensors are in host memory once :meth:`take` returns."""

    def __init__(self, document: object, events: list, kept: list[torch.Tensor]) -> None:
        self._document, self._events, self._kept = document, events, kept

    def take(self) -> object:
        """The document, once every copy to host memory has arrived (on the writer thread)."""
        cuda = streams.api()
        for event in self._events:
            cuda.host_wait(event, _WHY_HOST_WAIT)
        self._events, self._kept = [], []
        return self._document


def wait_for(runtime: Runtime, process_set: ProcessSet) -> None:
    """Wait for ``process_set``'s background save in flight, if any, raising its error unless
    its handle did (what a synchronous save does first); no communication."""
    saver = runtime.savers.get(process_set.process_set_id)
    if saver is not None:
        saver.wait()


def saver_of(runtime: Runtime, process_set: ProcessSet) -> BackgroundSaver:
    """The background writer of ``process_set``'s saves, made at its first background save
    (collective then over the set's members, which all call it at that save)."""
    runtime.topology.communicator(process_set)  # raises for an unregistered set or a non-member
    set_id = process_set.process_set_id
    saver = runtime.savers.get(set_id)
    if saver is None:
        group = runtime.topology.direct_over(runtime.topology.ranks_of(process_set),
                                             key=f"background saves of process set {set_id}",
                                             name=f"the background saves of {process_set!r}")
        saver = runtime.savers[set_id] = BackgroundSaver(group)
    return saver
