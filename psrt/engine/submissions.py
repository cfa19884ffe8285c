"""The engine's submissions: what callers have handed in and the engine has not finished.

Any thread may submit; the thread running the engine's cycle takes what arrived.  This part
owns the queue, the set of works in flight (queued, negotiating or running: a name may be
submitted again only once its previous work is done), the wake-up of a sleeping engine
thread, and the refusals: once the engine has stopped, or a rank of a work's process set
has shut down, a submission fails at once, naming why.  Everything here is guarded by one
lock, held for a few operations at a time.
"""
from __future__ import annotations

import threading
import time

from psrt.engine.work import Announcement, Work, WorkKey
from psrt.errors import EngineStoppedError, InvalidArgumentError


def shut_down_by(ranks: list[int]) -> str:
    """Why a work needing ``ranks`` (which have shut down) cannot run."""
    return f"psrt was shut down by rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class Submissions:
    """One rank's submitted works (see the module's docstring); thread-safe."""

    __slots__ = ("_lock", "_queue", "_in_flight", "_wake", "_last_submit", "_refusal", "_gone", "rank")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._queue: list[Work] = []
        self._in_flight: set[WorkKey] = set()
        self._wake = threading.Event()
        self._last_submit = 0.0  # when asynchronous work last arrived
        self._refusal: str | None = None  # why every submission fails: the engine stopped
        self._gone: set[int] = set()  # ranks that have shut down

    # -- callers ----------------------------------------------------------------------------
    def put(self, work: Work, wake: bool = True) -> None:
        """Queue ``work``; ``wake=False`` leaves the engine thread asleep (a caller about to run
        the cycle itself)."""
        announcement = work.announcement
        with self._lock:
            self._check(announcement)
            self._in_flight.add(announcement.key)
            self._queue.append(work)
        if wake:
            self._last_submit = time.perf_counter()
            if not self._wake.is_set():  # setting an event takes its lock: once per burst
                self._wake.set()

    def claim(self, announcement: Announcement) -> bool:
        """Take ``announcement``'s key in flight for a work run straight from the caller, if
        nothing else is in flight or queued here (the express path); refused submissions
        raise as :meth:`put` does."""
        with self._lock:
            if self._in_flight:
                return False
            self._check(announcement)
            self._in_flight.add(announcement.key)
        return True

    def _check(self, announcement: Announcement) -> None:
        if self._refusal is not None:
            raise EngineStoppedError(f"cannot run {announcement.describe()}: {self._refusal}")
        if self._gone:
            gone = sorted(self._gone.intersection(announcement.ranks))
            if gone:
                raise EngineStoppedError(f"cannot run {announcement.describe()}: {shut_down_by(gone)}")
        if announcement.key in self._in_flight:
            raise InvalidArgumentError(
                f"{announcement.describe()} is already pending on rank {self.rank}: a name may be "
                "submitted again only after the previous operation completed")

    def idle(self) -> bool:
        """Whether nothing is in flight here (read without the lock: a cheap first look)."""
        return not self._in_flight

    def pending_in(self, set_id: int) -> list[str]:
        """Names of this rank's unfinished works on a process set."""
        with self._lock:
            return sorted(name for sid, name in self._in_flight if sid == set_id)

    def queued_keys(self) -> tuple[WorkKey, ...]:
        """The keys of the works queued and not taken yet (for the watchdog's descriptions)."""
        return tuple(work.key for work in tuple(self._queue))  # one step under the GIL

    # -- the thread running the cycle ---------------------------------------------------------
    def take(self) -> list[Work]:
        """What arrived since the last take, in order."""
        if self._wake.is_set():
            self._wake.clear()
        with self._lock:
            arrived, self._queue = self._queue, []
        return arrived

    def has_queued(self) -> bool:
        return bool(self._queue)

    def finished(self, work: Work, value: object, error: BaseException | None) -> None:
        """``work`` is over: its name may be submitted again, and its waiter wakes."""
        with self._lock:
            self._in_flight.discard(work.announcement.key)
        if error is None:
            work.complete(value)
        else:
            work.fail(error)

    def released(self, key: WorkKey) -> None:
        """A key :meth:`claim` took is free again (its allreduce ran with no work).  No lock:
        one discard is atomic, and no submission waits on this key (it was in flight)."""
        self._in_flight.discard(key)

    def wake(self) -> None:
        self._wake.set()

    def wait_for_news(self, timeout: float) -> bool:
        """Sleep until something is submitted or :meth:`wake` is called (at most ``timeout``
        seconds); whether it was."""
        return self._wake.wait(timeout)

    def let_burst_gather(self, gather_s: float) -> None:
        """Wait until submissions have paused for ``gather_s`` (a step's gradients arrive in a
        burst: one round then negotiates all of it, and the caller's Python is not slowed by
        this thread's)."""
        while (since := time.perf_counter() - self._last_submit) < gather_s:
            time.sleep(gather_s - since)

    # -- the lifecycle ------------------------------------------------------------------------
    def refuse(self, reason: str) -> list[Work]:
        """Fail every later submission with ``reason``; returns the queued works, now dropped
        (their keys are no longer in flight)."""
        with self._lock:
            self._refusal = reason
            dropped, self._queue = self._queue, []
            self._in_flight.clear()
        self._wake.set()
        return dropped

    def ranks_gone(self, gone: set[int], dropped: list[Work]) -> list[Work]:
        """Ranks ``gone`` have shut down: refuse works that need them from now on, and drop the
        queued ones and ``dropped`` (the cycle's, already out of its hands) from the works in
        flight; returns every work dropped."""
        with self._lock:
            self._gone.update(gone)
            doomed = [w for w in self._queue if gone.intersection(w.announcement.ranks)]
            self._queue = [w for w in self._queue if not gone.intersection(w.announcement.ranks)]
            for work in doomed + dropped:
                self._in_flight.discard(work.key)
        return doomed + dropped

    def gone(self) -> list[int]:
        """The ranks known to have shut down."""
        with self._lock:
            return sorted(self._gone)
