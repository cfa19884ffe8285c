"""The engine's cycle: one negotiation round, then what every rank agreed to run.

A cycle takes what callers submitted (:mod:`psrt.engine.submissions`), negotiates with the
other ranks (:mod:`psrt.engine.negotiation`) which works are ready on every member of their
process set, and runs those in the agreed order (:mod:`psrt.engine.execution`: fusion,
communicators, timeline, autotuning).  It owns what only the thread running it touches:
the negotiator and its response cache, the works negotiating, the quiet epochs and the
doorbell that ends them, and the watchdog marks of the threads that run it.  Its express
path runs a lone cached allreduce straight from a blocking caller: its round, then its
reduction.  What a round means for joins, shutdown and stalls is the lifecycle's
(:mod:`psrt.engine.lifecycle`), which gets the round's result.

Whoever holds the engine's driver runs a cycle: the engine thread, or a caller blocked on a
collective (see :mod:`psrt.engine.engine`).
"""
from __future__ import annotations

import threading
import time

import torch

from psrt.comm import poll
from psrt.comm.base import Request
from psrt.comm.waits import Wait
from psrt.comm.watchdog import Watchdog
from psrt.config import Config
from psrt.engine.doorbell import Doorbell
from psrt.engine.execution import Execution
from psrt.engine.negotiation import Negotiator, RoundResult
from psrt.engine.submissions import Submissions
from psrt.engine.work import Route, Work, WorkKey

_BRIEF_WAIT_CYCLES = 10
# A work still waiting for other ranks after this long is announced through the
# slow path, so that the shared table (and the stall report) knows of it.
_REPORT_AFTER_S = 1.0
# How often the express path tests its round before waiting as every round does (with a
# watchdog mark, spinning and then napping): a test takes well under a microsecond.
_EXPRESS_TESTS = 64


class Cycle:
    """One rank's negotiation and execution (see the module's docstring).  Of the other parts
    it calls the submissions' ``take``, ``finished``, ``released`` and ``has_queued``."""

    __slots__ = ("rank", "_everyone", "_submissions", "_watchdog", "_negotiator", "_doorbell", "_execution",
                 "_local", "_express_ranks", "_quiet_epoch", "_unrung", "_report_after", "_thread_marks")

    def __init__(self, topology, config: Config, watchdog: Watchdog, submissions: Submissions) -> None:
        world = topology.world
        self.rank = world.rank
        self._everyone = tuple(range(world.size))
        self._submissions = submissions
        self._watchdog = watchdog
        self._negotiator = Negotiator(world.split(0, key=world.rank), config.cache_capacity)
        self._doorbell = Doorbell(world.split(0, key=world.rank))
        self._execution = Execution(topology, config, watchdog, submissions)
        self._local: dict[WorkKey, Work] = {}  # this rank's works being negotiated
        self._express_ranks: tuple[int, ...] = ()  # the set of the express call in its round
        self._quiet_epoch: int | None = 0  # every engine starts quiet, at round 0
        self._unrung: int | None = None  # the quiet epoch left without ringing yet
        self._report_after = min(_REPORT_AFTER_S, config.stall_check_time_s / 4)
        self._thread_marks: dict[int, tuple[Wait, Wait]] = {}  # per thread that runs cycles

    @property
    def cycle_time_s(self) -> float:
        return self._execution.cycle_time_s

    # -- a cycle --------------------------------------------------------------------------
    def run(self, join: bool, stop: bool) -> RoundResult | None:
        """Take what arrived and negotiate one round announcing ``join`` and ``stop`` (this
        rank's requests not announced yet), then run what every rank is ready for.  None when
        every engine is quiet and this rank has nothing to bring: no round is held."""
        arrived = self._submissions.take()
        if self._quiet_epoch is not None:
            if not (arrived or join or stop):
                return None
            self._unrung, self._quiet_epoch = self._quiet_epoch, None
        timeline = self._execution.timeline  # read once: stop_timeline() may clear it meanwhile
        if timeline is not None:
            timeline.cycle(time.perf_counter())
        fresh = self._accept(arrived)
        with self._marks(threading.get_ident())[0]:
            result = self._negotiator.round(self._local, fresh, join, stop, self._wait_for_round)
        self._run_agreed(result, timeline is not None)
        return result

    def _run_agreed(self, result: RoundResult, stamped: bool) -> None:
        if stamped:  # phases are stamped only for the timeline
            now = time.perf_counter()
            for work in self._local.values():
                if work.negotiated is None:
                    work.negotiated = now
        if result.responses:
            self._execution.run(result.responses, self._local, self._marks(threading.get_ident())[1])

    def pause(self, result: RoundResult) -> float | None:
        """How long to wait before the next cycle after ``result`` (whose joins and shutdowns
        the lifecycle has settled): None when every engine goes quiet at this round."""
        if not result.waiting:  # the same on every rank: all go quiet at this round
            self._quiet_epoch = self._negotiator.rounds
            return None
        if result.responses or self._submissions.has_queued() or self._waiting_briefly():
            return 0.0
        return self._execution.cycle_time_s

    def rung(self) -> bool:
        """While quiet: whether this rank must negotiate again (another rank rang, or the
        quiet epoch already ended); one look at the doorbell."""
        if self._quiet_epoch is None:
            return True
        if self._doorbell.rang(self._quiet_epoch):
            self._quiet_epoch = None
            return True
        return False

    def _accept(self, arrived: list[Work]) -> list[Work]:
        """Take in new works; return those to announce now: unknown to the cache, or
        waiting for other ranks for long."""
        fresh = []
        cache = self._negotiator.cache
        for work in arrived:
            self._local[work.key] = work
            work.cache_index = cache.lookup(work.announcement)
            if work.cache_index is None:
                fresh.append(work)
        if len(self._local) > len(arrived):  # some waited from earlier cycles
            overdue = time.perf_counter() - self._report_after
            seen = set(map(id, fresh))
            fresh += [w for w in self._local.values()
                      if not w.reported and w.submitted < overdue and id(w) not in seen]
        return fresh

    def _waiting_briefly(self) -> bool:
        """Whether a local work has been waiting for other ranks only a few cycles.

        Rounds are collective, so a rank that sleeps a cycle delays every other
        rank's next round: while its works are likely to become ready soon, a
        rank goes straight to the next round (which waits, without spinning,
        for the others to arrive).  Long waits fall back to one round per cycle.
        """
        recent = time.perf_counter() - _BRIEF_WAIT_CYCLES * self._execution.cycle_time_s
        return any(work.submitted > recent for work in self._local.values())

    # -- the express path -------------------------------------------------------------------
    def can_express(self, route: Route) -> bool:
        """A cheap first look (without the driver) at whether :meth:`express` may run: no
        timeline, nothing announced or joined anywhere, and the route's work cached."""
        negotiator = self._negotiator
        if self._execution.timeline is not None or negotiator.table or negotiator.joined:
            return False
        if route.index is None:
            route.index = negotiator.cache.lookup(route.announcement)
        return route.index is not None

    def express(self, route: Route, buffer: torch.Tensor) -> tuple[Work, RoundResult] | None:
        """Run the allreduce of ``buffer`` (contiguous; its key claimed in flight) straight from
        the caller: when its round shows it ready everywhere and nothing else going on, it runs
        here and every rank goes quiet, as after any such round (None is returned).  Any other
        outcome is acted on as by :meth:`run`, with a work for the allreduce pending here; that
        work and the round's result are returned (the work completes in a later cycle, or
        fails)."""
        if self._quiet_epoch is not None:
            self._unrung, self._quiet_epoch = self._quiet_epoch, None
        announcement = route.announcement
        self._express_ranks = announcement.ranks  # members: they come with the call, never rung
        fast = self._negotiator.round_alone(route.index, self._wait_alone)
        self._express_ranks = ()  # (a round that raises stops the engine: nothing reads it again)
        if fast is not None:
            work = Work(announcement, device=buffer.device, buffers=[buffer])
            work.cache_index = route.index
            self._local[announcement.key] = work
            with self._marks(threading.get_ident())[0]:  # the round's slow path, if any rank asked for it
                result = self._negotiator.complete_round(self._local, *fast, False, False)
            self._run_agreed(result, False)
            return work, result
        self._execution.express(route, buffer, self._marks(threading.get_ident())[1])
        self._submissions.released(announcement.key)
        self._quiet_epoch = self._negotiator.rounds
        return None

    def _wait_alone(self, request: Request) -> None:
        """Wait for the express path's round: first by testing it back to back (a round of
        ranks in step needs a few tests, each of which moves it on, and the watchdog needs no
        mark for a wait of microseconds), then as every round waits."""
        for _ in range(_EXPRESS_TESTS):
            if request.test():
                self._unrung = None
                return
        with self._marks(threading.get_ident())[0]:
            self._wait_for_round(request)

    # -- waiting for a round ----------------------------------------------------------------
    def _marks(self, thread: int) -> tuple[Wait, Wait]:
        """A thread's watchdog marks for negotiation rounds and for collectives (a mark serves
        one thread; the second says what it is when entered)."""
        marks = self._thread_marks.get(thread)
        if marks is None:
            marks = self._thread_marks[thread] = (
                self._watchdog.waiting("an engine negotiation round", self._describe_round, self._everyone),
                self._watchdog.waiting("an engine collective", "", self._everyone))
        return marks

    def _wait_for_round(self, request: Request) -> None:
        """Wait for a negotiation round as every psrt wait does (:mod:`psrt.comm.poll`).

        A rank leaving a quiet epoch rings the doorbell only for ranks that cannot come by
        themselves, and only once the round has not completed within the spin (ranks of
        one program mostly arrive together): those outside the process sets of its pending
        works, which have nothing to submit.  Members will come with the work; ringing
        them would make a rank still computing (a step's backward) spend its core on
        rounds, which slows it and everyone waiting for it.  They are rung too once the
        work has waited as long as the stall report needs the table to know of it."""
        if request.test():  # the peers were there first
            self._unrung = None
            return
        backoff = poll.Backoff()
        start = time.perf_counter()
        outsiders_rung = False
        while not request.test():
            if self._unrung is not None:
                waited = time.perf_counter() - start
                if waited > self._report_after:
                    self._doorbell.ring(self._unrung)
                    self._unrung = None
                elif not outsiders_rung and waited > poll.SPIN_S:
                    outsiders = self._outsiders()
                    if outsiders:
                        self._doorbell.ring(self._unrung, outsiders)
                    outsiders_rung = True
            backoff.idle()
        self._unrung = None

    def _outsiders(self) -> list[int]:
        """Ranks outside the process set of every work pending here (all others when none
        is: a join or a shutdown needs every rank's rounds)."""
        members = set(self._express_ranks).union(*(work.announcement.ranks for work in self._local.values()))
        return [rank for rank in self._everyone if rank != self.rank and rank not in members]

    def _describe_round(self) -> str:
        # each tuple() is one step under the GIL: the engine thread and callers change these
        pending = tuple(self._local) + self._submissions.queued_keys()
        names = ", ".join(repr(name) for _, name in pending[:3]) + (f" and {len(pending) - 3} more"
                                                                   if len(pending) > 3 else "")
        return (f"rank {self.rank}'s engine negotiation round (which collectives every rank is ready to run; "
                f"{'pending here: ' + names if pending else 'nothing pending here'})")

    # -- what the lifecycle asks ------------------------------------------------------------
    def missing(self, key: WorkKey) -> list[int] | None:
        """The ranks that have not submitted work ``key`` (None while no round announced it);
        read from the watchdog's thread."""
        return self._negotiator.missing(key)

    def joined(self) -> list[int]:
        """The ranks that have joined so far."""
        return list(self._negotiator.joined)

    def stalled(self, older_than: float) -> list[tuple[str, float, list[int], list[int]]]:
        """What has waited at least ``older_than`` seconds for some ranks (see
        :meth:`Negotiator.stalled`)."""
        return self._negotiator.stalled(older_than)

    def forget_involving(self, gone: set[int]) -> list[Work]:
        """Ranks ``gone`` have shut down: drop what needs them (the table's and this rank's
        works) and the current join; returns this rank's works dropped."""
        self._negotiator.forget_involving(gone)
        doomed = [w for w in self._local.values() if gone.intersection(w.announcement.ranks)]
        for work in doomed:
            del self._local[work.key]
        return doomed

    def abandon(self) -> list[Work]:
        """The engine stopped: hand over every work being negotiated, to be failed."""
        abandoned, self._local = list(self._local.values()), {}
        return abandoned

    # -- timeline and closing -----------------------------------------------------------------
    def start_timeline(self, path: str, mark_cycles: bool, asked_by: str) -> None:
        self._execution.start_timeline(path, mark_cycles, asked_by)

    def stop_timeline(self) -> None:
        self._execution.stop_timeline()

    def close_doorbell(self) -> None:
        """Deliver this rank's last rings and close the doorbell (once the last cycle ran)."""
        self._doorbell.close()

    def close(self) -> None:
        """Free the negotiation's communicators (after :meth:`close_doorbell`)."""
        self._negotiator.close()
        self._execution.close()
