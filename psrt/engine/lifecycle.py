"""The engine's lifecycle: join, shutdown, stall reports, and failing the works left.

``join()`` and ``shutdown()`` are requests every rank announces in a negotiation round;
this part holds them until announced and acts on what the rounds report: a join completes
once every rank has joined; ranks that shut down make the works needing them fail at once,
naming them, and the engine stops once every rank has.  On rank 0 it publishes the works
some ranks have not submitted to the watchdog (the negotiation table is the same on every
rank), which reports them after ``stall_check_time_s`` naming the ranks to blame and ends the
job after ``stall_shutdown_time_s``.  When a cycle fails it stops the engine, fails every
work left, and by default aborts the job, so that no caller is left waiting on a dead engine.
"""
from __future__ import annotations

import logging
import threading
import time

from psrt.comm import bootstrap
from psrt.comm.ranks import rank_ranges
from psrt.comm.waits import Wait
from psrt.comm.watchdog import Watchdog, combined
from psrt.config import Config
from psrt.engine.cycle import Cycle
from psrt.engine.negotiation import RoundResult
from psrt.engine.submissions import Submissions, shut_down_by
from psrt.engine.work import Work
from psrt.errors import EngineStoppedError

logger = logging.getLogger("psrt")

_STALL_CHECK_INTERVAL_S = 0.5
_UNSUBMITTED = "a collective some ranks have not submitted"


class Lifecycle:
    """One rank's joins, shutdown, stalls and failure (see the module's docstring).  Of the
    other parts it calls the submissions' ``refuse``, ``ranks_gone``, ``gone`` and ``wake``,
    and the cycle's ``joined``, ``stalled``, ``forget_involving`` and ``abandon``."""

    __slots__ = ("rank", "size", "_everyone", "_config", "_watchdog", "_submissions", "_cycle", "_lock", "_stopped",
                 "_join_requested", "_join_sent", "_join_done", "_join_value", "_stop_requested", "_stop_sent",
                 "_next_stall_check", "_stalls_published")

    def __init__(self, rank: int, size: int, config: Config, watchdog: Watchdog, submissions: Submissions,
                 cycle: Cycle) -> None:
        self.rank, self.size = rank, size
        self._everyone = tuple(range(size))
        self._config = config
        self._watchdog = watchdog
        self._submissions = submissions
        self._cycle = cycle
        # Held while a join is asked for, and while ranks that shut down or the engine's stop
        # are noted: a join either sees them and refuses, or is failed by them, never neither.
        self._lock = threading.Lock()
        self._stopped: str | None = None  # why the engine stopped, once it has
        self._join_requested = self._join_sent = False
        self._join_done = threading.Event()
        self._join_value: int | BaseException | None = None
        self._stop_requested = self._stop_sent = False
        self._next_stall_check = 0.0
        self._stalls_published = False

    @property
    def stopped(self) -> str | None:
        """Why the engine stopped, once it has (None while it runs)."""
        return self._stopped

    # -- requests ----------------------------------------------------------------------------
    def requests(self) -> tuple[bool, bool]:
        """This rank's (join, shutdown) requests that the next round must announce."""
        return (self._join_requested and not self._join_sent), (self._stop_requested and not self._stop_sent)

    def busy(self) -> bool:
        """Whether a join or a shutdown is requested here (the express path stands aside)."""
        return self._join_requested or self._stop_requested

    def join(self) -> int:
        """Block until every rank has joined (the cycles contribute zeros meanwhile); returns the
        last rank to join."""
        with self._lock:
            if self._stopped is not None:
                raise EngineStoppedError(f"cannot join: {self._stopped}")
            gone = self._submissions.gone()
            if gone:  # a join needs every rank, and these will never join
                raise EngineStoppedError(f"cannot join: {shut_down_by(gone)}")
            self._join_done.clear()
            self._join_requested = True
        self._submissions.wake()
        # the engine's table reports a join's stall (a wait by design: never fatal)
        with self._watchdog.waiting("a join", f"hvd.join() on rank {self.rank}", self._everyone, ident=("join",),
                                    needs=self._not_joined, stalls=False):
            self._join_done.wait()
        if isinstance(self._join_value, BaseException):
            raise self._join_value
        return self._join_value

    def _not_joined(self) -> list[int]:
        joined = set(self._cycle.joined())
        return [r for r in self._everyone if r not in joined and r != self.rank]

    def request_stop(self) -> None:
        self._stop_requested = True
        self._submissions.wake()

    def not_gone(self) -> list[int]:
        """The other ranks that have not called shutdown yet."""
        gone = set(self._submissions.gone())
        return [r for r in self._everyone if r not in gone and r != self.rank]

    def describe_shutdown(self) -> str:
        missing = self.not_gone()
        waiting = f"rank{'s' if len(missing) > 1 else ''} {rank_ranges(missing)}" if missing else "the other ranks"
        return f"rank {self.rank}'s psrt.shutdown() (at exit, or called; waiting for {waiting} to shut down too)"

    # -- after each round ---------------------------------------------------------------------
    def settle(self, result: RoundResult, join: bool, stop: bool) -> bool:
        """Act on a round that announced ``join`` and ``stop``: a completed join, stalls, ranks
        shutting down.  True once every rank has shut down (the engine has stopped)."""
        self._join_sent, self._stop_sent = self._join_sent or join, self._stop_sent or stop
        if result.join_completed is not None:
            self._join_value, self._join_sent = result.join_completed, False
            self._join_requested = False
            self._join_done.set()
        self.inspect_stalls()
        if result.shutdown_by:
            if self._shut_down(result.shutdown_by):
                return True
            self._join_sent = False  # a pending join failed: a later one is announced afresh
        if not result.waiting and self._stalls_published:  # going quiet: nothing must stay published
            self.inspect_stalls(force=True)
        return False

    def inspect_stalls(self, force: bool = False) -> None:
        """On rank 0: publish the works some ranks have not submitted (the table is the same
        on every rank) for the watchdog to report, naming what the missing ranks do: all of
        them as one wait, and a join apart, since waiting for the others to join is by design
        and never ends the job.  Forced when going quiet: nothing must stay published."""
        now = time.monotonic()
        if self.rank != 0 or (now < self._next_stall_check and not force):
            return
        self._next_stall_check = now + min(_STALL_CHECK_INTERVAL_S, self._config.stall_check_time_s / 4)
        stalled = self._cycle.stalled(self._config.stall_check_time_s / 2)
        unsubmitted = [self._unsubmitted(*item, now) for item in stalled if item[0] != "join"]
        joins = [self._unsubmitted(*item, now) for item in stalled if item[0] == "join"]
        self._watchdog.publish("engine", combined(_UNSUBMITTED, unsubmitted, key="unsubmitted")
                               + combined(_UNSUBMITTED, joins, key="join", ends_job=False))
        self._stalls_published = bool(stalled)

    def after_quiet_round(self) -> None:
        """An express round ran its allreduce and every rank went quiet."""
        if self.rank == 0:
            self.inspect_stalls(force=self._stalls_published)

    def _unsubmitted(self, what: str, age: float, have: list[int], missing: list[int], now: float) -> Wait:
        return Wait(_UNSUBMITTED, f"{what}, submitted by ranks {have} but not by missing ranks {missing} (a rank "
                                  "may be stuck, or ranks are calling different collectives),",
                    self._watchdog.job_ranks(missing), now - age)

    def _shut_down(self, stopping: list[int]) -> bool:
        """Note ranks that called shutdown; fail the works that need them.  True once every
        rank has (the engine then stops)."""
        gone = set(self._submissions.gone()) | set(stopping)
        if len(gone) == self.size:
            self._submissions.ranks_gone(gone, [])
            self._stop(shut_down_by(sorted(stopping)))
            return True
        with self._lock:
            doomed = self._submissions.ranks_gone(gone, self._cycle.forget_involving(gone))
            self._fail_join(f"join did not complete: {shut_down_by(sorted(gone))}")  # a join needs every rank
        for work in doomed:
            reason = shut_down_by(sorted(gone.intersection(work.announcement.ranks)))
            work.fail(EngineStoppedError(f"{work.announcement.describe()} did not complete: {reason}"))
        return False

    def _fail_join(self, message: str) -> None:
        """Fail a join in progress (holding the lock)."""
        if self._join_requested and not self._join_done.is_set():
            self._join_requested = False
            self._join_value = EngineStoppedError(message)
            self._join_done.set()

    # -- failure -----------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """A cycle failed: stop the engine and, by default, abort the job (never leave callers
        waiting on a dead engine)."""
        how = f"psrt engine failed: {bootstrap.describe_exception(exc)}"
        logger.exception("psrt: rank %d: %s", self.rank, how)
        self._stop(how)
        if self._config.abort_on_exception and self.size > 1:
            bootstrap.abort_job(how)

    def _stop(self, reason: str) -> None:
        with self._lock:
            self._stopped = reason
            self._fail_join(f"join did not complete: {reason}")
        abandoned: list[Work] = self._submissions.refuse(reason) + self._cycle.abandon()
        for work in abandoned:
            work.fail(EngineStoppedError(f"{work.announcement.describe()} did not complete: {reason}"))
