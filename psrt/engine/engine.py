"""The background engine: a thread per process through which every named collective runs.

Callers submit named :class:`Work` and return at once.  Each cycle the engine
drains what was submitted, negotiates with the other ranks (see
:mod:`psrt.engine.negotiation`) which works are ready on every member of their
process set, and runs those in the agreed order — allreduces fused into as few
messages as the fusion threshold allows.  Ranks may therefore submit the same
named collectives in different orders, as gradients become ready in different
orders.  A caller that waits runs the cycles itself rather than handing them to the
engine thread; a lone blocking allreduce of a cached name needs only its round and its
reduction (:meth:`Engine.express`).

The engine never lets a job hang silently: disagreeing arguments fail the
work on every rank with one message; a work some ranks never submit is
published to the watchdog, and so is every round and collective the engine
thread waits in (a frozen rank blocks the round itself), which reports them
after ``stall_check_time_s`` naming the ranks to blame and ends the job after
``stall_shutdown_time_s``; a failure of the engine itself aborts the job.

The engine is three parts, each owning its state, and this module, which holds them and
decides who runs a cycle when:

* :mod:`psrt.engine.submissions`: what callers handed in (thread-safe);
* :mod:`psrt.engine.cycle`: negotiation and execution (:mod:`psrt.engine.execution`);
* :mod:`psrt.engine.lifecycle`: join, shutdown, stalls, failure.

Strategies reach the engine through a :class:`psrt.engine.channel.Channel`.
"""
from __future__ import annotations

import threading

import torch

from psrt.comm import streams
from psrt.comm.waits import Wait
from psrt.comm.watchdog import Watchdog
from psrt.config import Config
from psrt.engine.cycle import Cycle
from psrt.engine.lifecycle import Lifecycle
from psrt.engine.negotiation import RoundResult
from psrt.engine.submissions import Submissions
from psrt.engine.work import Announcement, Route, StreamDependencies, Work
from psrt.errors import EngineStoppedError

# While every engine is quiet, the doorbell is polled after this long, then ever
# more slowly up to the longest nap: a rung rank (one without work of its own, or
# not yet) joins the round within that.  A poll's own work is a few microseconds, but
# waking a sleeping thread costs about 0.1 ms of CPU on a virtual machine (a bare
# Python Event.wait loop measured 98 us a wake), so the longest nap sets the idle
# cost: 0.7 % of a core at 20 ms, 0.3 % at 50 ms.  Only a collective that needs a rank
# quiet for that long, with no work of its own, waits for it that long.
_FIRST_QUIET_NAP_S = 200e-6
_LONGEST_QUIET_NAP_S = 50e-3


class Engine:
    """One rank's engine: its three parts, the engine thread, and who drives the cycle.

    Whoever holds the driver runs the next cycle: the engine thread, or a caller waiting for
    a work (no hand-off to another thread and back)."""

    __slots__ = ("rank", "_everyone", "_watchdog", "_submissions", "_cycle", "_lifecycle", "_driver", "_driving",
                 "_call_marks", "_thread")

    def __init__(self, topology, config: Config, watchdog: Watchdog) -> None:
        self.rank = topology.world.rank
        self._everyone = tuple(range(topology.world.size))
        self._watchdog = watchdog
        self._submissions = Submissions(self.rank)
        self._cycle = Cycle(topology, config, watchdog, self._submissions)
        self._lifecycle = Lifecycle(self.rank, topology.world.size, config, watchdog, self._submissions,
                                    self._cycle)
        self._driver = threading.Lock()
        self._driving: int | None = None  # the thread running a cycle
        self._call_marks: dict[int, Wait] = {}  # per waiting thread (see _call_mark)
        self._thread = threading.Thread(target=self._run, name="psrt-engine", daemon=True)
        self._thread.start()

    # -- submitting and waiting -----------------------------------------------------------
    def submit(self, work: Work, wake: bool = True) -> Work:
        """Queue ``work``; ``wake=False`` leaves the engine thread asleep (a caller about to
        wait for it, which runs the cycles itself)."""
        if streams.api().covers(work.device):
            work.streams = StreamDependencies(work.device)
        self._submissions.put(work, wake)
        return work

    def run(self, work: Work) -> object:
        """Submit ``work`` and return its output, running the engine's cycles on this thread
        meanwhile (see :meth:`wait`)."""
        return self.wait(self.submit(work, wake=False))

    def wait(self, work: Work) -> object:
        """Return ``work``'s output (or raise its error), running the engine's cycles on this
        thread until it is done: a caller that blocks on a collective negotiates and runs it
        itself, with no hand-off to the engine thread and back (which takes over whenever
        this one sleeps).  The cycles are the engine thread's own, so names are matched,
        works fused, ordered, checked and watched exactly as for asynchronous work.  Within a
        cycle (an ``execute`` callable) the work can only be waited for."""
        if not work.done():
            self._drive(work)
        return work.result()

    def _drive(self, work: Work) -> None:
        thread = threading.get_ident()
        if self._driving == thread:
            work.wait()
            return
        call = self._call_mark(thread)
        announcement = work.announcement
        call.what, call.peers = announcement.describe, announcement.ranks
        call.ident = ("engine", *work.key)  # its needs read the table by it (see _call_mark)
        pause: float | None
        with call:
            while not work.done():
                with self._driver:
                    pause = 0.0 if work.done() or self._lifecycle.stopped is not None else self._drive_once()
                if pause is None:  # quiet, yet not done: another driver is finishing it
                    pause = self._cycle.cycle_time_s
                if pause:
                    work.wait(pause)

    def _call_mark(self, thread: int) -> Wait:
        """A waiting thread's mark for the call it is blocked in, for deadlock detection only
        (a call's stall is the engine table's, published by the lifecycle)."""
        call = self._call_marks.get(thread)
        if call is None:
            call = self._call_marks[thread] = self._watchdog.waiting("a blocking engine call", "", self._everyone,
                                                                     stalls=False)
            call.needs = lambda: self._cycle.missing(call.ident[1:])  # the ranks that lack the work
        return call

    @staticmethod
    def route(announcement: Announcement) -> Route:
        """The express path's token for a repeated blocking allreduce of one buffer whose
        scale is folded into ``announcement``'s reduction."""
        return Route(announcement)

    def express(self, route: Route, buffer: torch.Tensor) -> bool:
        """Run a blocking allreduce of ``buffer`` (contiguous) on ``route`` straight from the
        caller, if the response cache knows it and nothing else is pending on this rank,
        announced or asked for: its round, then its reduction, with no queue, no :class:`Work`
        and no hand-off (the steady state of a loop of blocking calls).  Should the round show
        anything else going on anywhere, a work for the allreduce joins the cycle as if it had
        been submitted, and this waits for it.  Returns whether the allreduce ran here (else
        nothing happened: submit it)."""
        if not self._submissions.idle() or not self._cycle.can_express(route):
            return False  # cheap looks first; the ones that count are made holding the driver
        if not self._driver.acquire(blocking=False):
            return False
        try:
            if self._lifecycle.busy() or not self._submissions.claim(route.announcement):
                return False
            self._driving = threading.get_ident()
            try:
                pending = self._cycle.express(route, buffer)
                if pending is None:
                    self._lifecycle.after_quiet_round()
                else:
                    self._settle(pending[1], False, False)
            except BaseException as exc:  # as in any cycle (see _drive_once)
                self._lifecycle.fail(exc)
                raise EngineStoppedError(f"cannot run {route.announcement.describe()}: "
                                         f"{self._lifecycle.stopped}") from exc
            finally:
                self._driving = None
        finally:
            self._driver.release()
        if pending is not None:
            self.wait(pending[0])
        return True

    # -- cycles ----------------------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread: cycles, sleeping between them as each cycle says."""
        while True:
            with self._driver:
                if self._lifecycle.stopped is not None:
                    return
                pause = self._drive_once()
            if pause is None:
                self._sleep_quietly()
            elif pause:
                self._submissions.wait_for_news(pause)

    def _drive_once(self) -> float | None:
        """One cycle by the thread holding the driver: how long to wait before the next one
        (None when every engine is quiet; 0 once the engine has stopped, should the cycle
        fail)."""
        self._driving = threading.get_ident()
        try:
            join, stop = self._lifecycle.requests()
            result = self._cycle.run(join, stop)
            if result is None:
                return None
            return self._settle(result, join, stop)
        except BaseException as exc:
            self._lifecycle.fail(exc)
            return 0.0
        finally:
            self._driving = None

    def _settle(self, result: RoundResult, join: bool, stop: bool) -> float | None:
        """The lifecycle's part of a round, then the pause the cycle asks for."""
        if self._lifecycle.settle(result, join, stop):
            return 0.0
        pause = self._cycle.pause(result)
        if pause is None and (self._submissions.has_queued() or any(self._lifecycle.requests())):
            return 0.0  # quiet everywhere, but news arrived here meanwhile
        return pause

    def _sleep_quietly(self) -> None:
        """While every engine is quiet: wake on this rank's own news, or when another rank
        rings; the doorbell is polled ever more slowly, so idling costs no measurable CPU."""
        nap = _FIRST_QUIET_NAP_S
        while not self._submissions.wait_for_news(nap):
            nap = min(2 * nap, _LONGEST_QUIET_NAP_S)
            if not self._driver.acquire(blocking=False):
                continue  # a caller drives: it will leave the quiet epoch itself
            try:
                if self._lifecycle.stopped is not None or self._cycle.rung():
                    return
            finally:
                self._driver.release()
        # Woken by news of this rank's own: let the burst it starts gather, so that one round
        # negotiates all of it.  A caller that blocks meanwhile drives at once.
        self._submissions.let_burst_gather(self._cycle.cycle_time_s)

    # -- join, shutdown, timeline --------------------------------------------------------------
    def join(self) -> int:
        """Block until every rank has joined; meanwhile contribute zeros to allreduces.
        Returns the last rank to join."""
        return self._lifecycle.join()

    def pending_in(self, set_id: int) -> list[str]:
        """Names of this rank's unfinished works on a process set."""
        return self._submissions.pending_in(set_id)

    def start_timeline(self, path: str, mark_cycles: bool = False, asked_by: str = "start_timeline()") -> None:
        """Write a timeline to ``path`` (on rank 0; other ranks ignore the call)."""
        self._cycle.start_timeline(path, mark_cycles, asked_by)

    def stop_timeline(self) -> None:
        self._cycle.stop_timeline()

    def shutdown(self) -> None:
        """Stop this rank's engine once every rank has called shutdown (collective, as
        ``MPI_Finalize`` is); meanwhile it keeps negotiating, so that other ranks' works on
        process sets without this rank still run, while works that need it fail at once,
        naming it."""
        self._lifecycle.request_stop()
        everyone = self._everyone
        with self._watchdog.waiting("psrt.shutdown()", self._lifecycle.describe_shutdown, everyone,
                                    ident=("shutdown",), needs=self._lifecycle.not_gone):
            self._thread.join()
        self._cycle.stop_timeline()
        with self._watchdog.waiting("psrt.shutdown()", f"rank {self.rank}'s psrt.shutdown(), delivering its last "
                                    "doorbell rings", everyone):
            self._cycle.close_doorbell()
        self._cycle.close()
