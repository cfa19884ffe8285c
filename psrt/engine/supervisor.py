"""The engine's supervisor: stall reports, failure and the collective shutdown.

It publishes the works some ranks have not submitted to the watchdog (rank 0 reads the
negotiation table, the same on every rank), which reports them after
``stall_check_time_s`` naming the ranks to blame and ends the job after
``stall_shutdown_time_s``; it fails the works that need a rank which has shut down, stops
the engine once every rank has, and stops it (aborting the job by default) when a cycle
fails, so that no caller is left waiting on a dead engine.

:class:`Supervisor` is one part of :class:`psrt.engine.Engine` (see
:mod:`psrt.engine.engine`), called by the executor's cycles (:mod:`psrt.engine.executor`)
and by ``psrt.shutdown()``.
"""
from __future__ import annotations

import logging
import time

from psrt.comm import bootstrap
from psrt.comm.ranks import rank_ranges
from psrt.comm.watchdog import Wait, combined
from psrt.errors import EngineStoppedError

logger = logging.getLogger("psrt")

_STALL_CHECK_INTERVAL_S = 0.5
_UNSUBMITTED = "a collective some ranks have not submitted"


class Supervisor:
    """Stalls, failure and shutdown (see the module's docstring).

    Works on the state :class:`~psrt.engine.Engine` builds; of the other parts it calls the
    executor's ``stop_timeline`` when shutting down."""

    def shutdown(self) -> None:
        """Stop this rank's engine once every rank has called shutdown (collective, as
        ``MPI_Finalize`` is); meanwhile it keeps negotiating, so that other ranks' works on
        process sets without this rank still run, while works that need it fail at once,
        naming it."""
        with self._lock:
            self._stop_requested = True
        self._wake.set()
        with self._watchdog.waiting("psrt.shutdown()", self._describe_shutdown, self._everyone, ident=("shutdown",),
                                    needs=self._not_gone):
            self._thread.join()
        self.stop_timeline()
        with self._watchdog.waiting("psrt.shutdown()", f"rank {self.rank}'s psrt.shutdown(), delivering its last "
                                    "doorbell rings", self._everyone):
            self._doorbell.close()
        self._negotiator.close()
        if self._autotune_comm is not None:
            self._autotune_comm.free()

    def _not_gone(self) -> list[int]:
        """The other ranks that have not called shutdown yet."""
        with self._lock:
            gone = set(self._gone)
        return [r for r in self._everyone if r not in gone and r != self.rank]

    def _describe_shutdown(self) -> str:
        missing = self._not_gone()
        waiting = f"rank{'s' if len(missing) > 1 else ''} {rank_ranges(missing)}" if missing else "the other ranks"
        return f"rank {self.rank}'s psrt.shutdown() (at exit, or called; waiting for {waiting} to shut down too)"

    def _failed(self, exc: BaseException) -> None:
        """A cycle failed: stop the engine and, by default, abort the job (never leave callers
        waiting on a dead engine)."""
        how = f"psrt engine failed: {bootstrap.describe_exception(exc)}"
        logger.exception("psrt: rank %d: %s", self.rank, how)
        self._stop(how)
        if self._config.abort_on_exception and self._world.size > 1:
            bootstrap.abort_job(how)

    def _inspect_stalls(self, force: bool = False) -> None:
        """On rank 0: publish the works some ranks have not submitted (the table is the same
        on every rank) for the watchdog to report, naming what the missing ranks do: all of
        them as one wait, and a join apart, since waiting for the others to join is by design
        and never ends the job.  Forced when going quiet: nothing must stay published."""
        now = time.monotonic()
        if self.rank != 0 or (now < self._next_stall_check and not force):
            return
        self._next_stall_check = now + min(_STALL_CHECK_INTERVAL_S, self._config.stall_check_time_s / 4)
        stalled = self._negotiator.stalled(self._config.stall_check_time_s / 2)
        unsubmitted = [self._unsubmitted(*item, now) for item in stalled if item[0] != "join"]
        joins = [self._unsubmitted(*item, now) for item in stalled if item[0] == "join"]
        self._watchdog.publish("engine", combined(_UNSUBMITTED, unsubmitted, key="unsubmitted")
                               + combined(_UNSUBMITTED, joins, key="join", ends_job=False))
        self._stalls_published = bool(stalled)

    def _unsubmitted(self, what: str, age: float, have: list[int], missing: list[int], now: float) -> Wait:
        return Wait(_UNSUBMITTED, f"{what}, submitted by ranks {have} but not by missing ranks {missing} (a rank "
                                  "may be stuck, or ranks are calling different collectives),",
                    self._watchdog.job_ranks(missing), now - age)

    def _shut_down(self, stopping: list[int]) -> bool:
        """Note ranks that called shutdown; fail the works that need them.  True once every
        rank has (the engine then stops)."""
        with self._lock:
            self._gone.update(stopping)
            gone = set(self._gone)
        if len(gone) == self._world.size:
            self._stop(_shut_down_by(sorted(stopping)))
            return True
        self._negotiator.forget_involving(gone)
        with self._lock:
            doomed = [w for w in list(self._local.values()) + self._queue if gone.intersection(w.announcement.ranks)]
            for work in doomed:
                self._local.pop(work.key, None)
                self._in_flight.discard(work.key)
            self._queue = [w for w in self._queue if w not in doomed]
        for work in doomed:
            reason = _shut_down_by(sorted(gone.intersection(work.announcement.ranks)))
            work.fail(EngineStoppedError(f"{work.announcement.describe()} did not complete: {reason}"))
        if self._join_requested and not self._join_done.is_set():  # a join needs every rank
            with self._lock:
                self._join_requested = False
            self._join_value = EngineStoppedError(f"join did not complete: {_shut_down_by(sorted(gone))}")
            self._join_done.set()
        return False

    def _stop(self, reason: str) -> None:
        with self._lock:
            self._stopped = reason
            abandoned = list(self._local.values()) + self._queue
            self._local, self._queue = {}, []
            self._in_flight.clear()
        for work in abandoned:
            work.fail(EngineStoppedError(f"{work.announcement.describe()} did not complete: {reason}"))
        if self._join_requested and not self._join_done.is_set():
            self._join_value = EngineStoppedError(f"join did not complete: {reason}")
            self._join_done.set()
        self._wake.set()  # the engine thread, if asleep, sees the engine has stopped


def _shut_down_by(ranks: list[int]) -> str:
    return f"psrt was shut down by rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
