"""The background engine: a thread per process through which every collective runs.

Callers submit named :class:`Work` and return at once.  Each cycle the engine
drains what was submitted, negotiates with the other ranks (see
:mod:`psrt.engine.negotiation`) which works are ready on every member of their
process set, and runs those in the agreed order — allreduces fused into as few
messages as the fusion threshold allows.  Ranks may therefore submit the same
named collectives in different orders, as gradients become ready in different
orders.  A caller that blocks runs the cycles itself rather than handing them to the
engine thread; a lone blocking allreduce of a cached name needs only its round and its
reduction (:meth:`Engine.express`).

The engine never lets a job hang silently: disagreeing arguments fail the
work on every rank with one message; a work some ranks never submit is
published to the watchdog, and so is every round and collective the engine
thread waits in (a frozen rank blocks the round itself), which reports them
after ``stall_check_time_s`` naming the ranks to blame and ends the job after
``stall_shutdown_time_s``; a failure of the engine itself aborts the job.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Callable

import torch

from psrt.comm import bootstrap, poll
from psrt.comm.base import Communicator, ReduceOp, Request
from psrt.comm.ranks import rank_ranges
from psrt.comm.watchdog import Wait, Watchdog, combined
from psrt.config import Config
from psrt.engine import fusion
from psrt.engine.autotune import Autotuner, Setting
from psrt.engine.doorbell import Doorbell
from psrt.engine.negotiation import Negotiator, Response, RoundResult
from psrt.engine.timeline import Timeline
from psrt.engine.work import Announcement, Express, Work, WorkKey
from psrt.errors import CollectiveMismatchError, EngineStoppedError, InvalidArgumentError

logger = logging.getLogger("psrt")

# A work still waiting for other ranks after this long is announced through the
# slow path, so that the shared table (and the stall report) knows of it.
_REPORT_AFTER_S = 1.0
_STALL_CHECK_INTERVAL_S = 0.5
_UNSUBMITTED = "a collective some ranks have not submitted"
_BRIEF_WAIT_CYCLES = 10
# While every engine is quiet, the doorbell is polled after this long, then ever
# more slowly up to the longest nap: a rung rank (one without work of its own, or
# not yet) joins the round within that.  A poll's own work is a few microseconds, but
# waking a sleeping thread costs about 0.1 ms of CPU on a virtual machine (a bare
# Python Event.wait loop measured 98 us a wake), so the longest nap sets the idle
# cost: 0.7 % of a core at 20 ms, 0.3 % at 50 ms.  Only a collective that needs a rank
# quiet for that long, with no work of its own, waits for it that long.
_FIRST_QUIET_NAP_S = 200e-6
_LONGEST_QUIET_NAP_S = 50e-3
# How often Engine.express tests its round before waiting as every round does (with a
# watchdog mark, spinning and then napping): a test takes well under a microsecond.
_EXPRESS_TESTS = 64


class Engine:
    def __init__(self, topology, config: Config, watchdog: Watchdog) -> None:
        self._topology = topology
        self._config = config
        self._watchdog = watchdog
        world = topology.world
        self._world = world
        self.rank = world.rank
        self._everyone = tuple(range(world.size))
        self._negotiator = Negotiator(world.split(0, key=world.rank), config.cache_capacity)
        self._lock = threading.Lock()
        self._queue: list[Work] = []
        self._in_flight: set[WorkKey] = set()
        self._wake = threading.Event()
        self._stopped: str | None = None
        self._stop_requested = False
        self._gone: set[int] = set()  # ranks that have called shutdown
        self._join_requested = False
        self._join_done = threading.Event()
        self._join_value: int | BaseException | None = None
        # Whoever holds the driver runs the next cycle: the engine thread, or a caller
        # blocked on a collective (no hand-off to another thread and back).  Only the
        # driver touches the state below.
        self._driver = threading.Lock()
        self._doorbell = Doorbell(world.split(0, key=world.rank))
        self._quiet_epoch: int | None = 0  # every engine starts quiet, at round 0
        self._unrung: int | None = None  # the quiet epoch left without ringing yet
        self._join_sent = self._stop_sent = False
        self._driving: int | None = None  # the thread running a cycle
        self._last_submit = 0.0  # when asynchronous work last arrived
        self._thread_marks: dict[int, tuple[Wait, Wait, Wait]] = {}  # per driving thread (see _marks)
        self._data_comms: dict[tuple[int, torch.device], Communicator] = {}
        self._local: dict[WorkKey, Work] = {}
        self._fusion = fusion.FusionBuffers()
        self._report_after = min(_REPORT_AFTER_S, config.stall_check_time_s / 4)
        self._next_stall_check = 0.0
        self._stalls_published = False
        self._timeline: Timeline | None = None
        self._autotuner: Autotuner | None = None
        self._autotune_comm = world.split(0, key=world.rank) if config.autotune else None
        if self._autotune_comm is not None:
            self._autotuner = Autotuner(Setting(config.fusion_threshold, config.cycle_time_ms),
                                        warmup_samples=config.autotune_warmup_samples,
                                        steps_per_sample=config.autotune_steps_per_sample, share=self._rank0s_score,
                                        rank=self.rank, log=config.autotune_log)
            self._apply(self._autotuner.setting)
        if config.timeline:
            self.start_timeline(config.timeline, config.timeline_mark_cycles, asked_by="PSRT_TIMELINE")
        self._thread = threading.Thread(target=self._run, name="psrt-engine", daemon=True)
        self._thread.start()

    # -- the caller's side --------------------------------------------------------------
    def submit(self, work: Work, wake: bool = True) -> Work:
        """Queue ``work``; ``wake=False`` leaves the engine thread asleep (a caller about to
        drive the cycle itself)."""
        with self._lock:
            if self._stopped is not None:
                raise EngineStoppedError(f"cannot run {work.announcement.describe()}: {self._stopped}")
            gone = sorted(self._gone.intersection(work.announcement.ranks)) if self._gone else None
            if gone:
                raise EngineStoppedError(f"cannot run {work.announcement.describe()}: {_shut_down_by(gone)}")
            if work.key in self._in_flight:
                raise InvalidArgumentError(
                    f"{work.announcement.describe()} is already pending on rank {self.rank}: a name may be "
                    "submitted again only after the previous operation completed")
            self._in_flight.add(work.key)
            self._queue.append(work)
        work.driver = self.drive
        if wake:
            self._last_submit = time.perf_counter()
            if not self._wake.is_set():  # setting an event takes its lock: once per burst
                self._wake.set()
        return work

    def run(self, work: Work) -> object:
        """Submit ``work`` and return its output, running the engine's cycles on this thread
        meanwhile (see :meth:`drive`)."""
        return self.submit(work, wake=False).result()

    def express(self, route: Express, buffer: torch.Tensor, make_work: Callable[[], Work]) -> bool:
        """Run a blocking allreduce of ``buffer`` (contiguous, its scale folded into the
        reduction of ``route``'s announcement) straight from the caller, if the response cache knows
        it and nothing else is pending on this rank, announced or asked for: its round, then
        its reduction, with no queue, no :class:`Work` and no hand-off (the steady state of a
        loop of blocking calls).  Should the round show anything else going on anywhere, the
        work ``make_work`` builds joins the cycle as if it had been submitted, and this waits
        for it.  Returns whether the allreduce ran here (else nothing happened: submit it)."""
        negotiator = self._negotiator
        if self._in_flight or self._timeline is not None or negotiator.table or negotiator.joined:
            return False  # cheap looks first; the ones that count are made holding the driver
        announcement, index = route.announcement, route.index
        if index is None:
            index = route.index = negotiator.cache.lookup(announcement)
            if index is None:
                return False
        if not self._driver.acquire(blocking=False):
            return False
        try:
            with self._lock:
                if (self._in_flight or self._gone or self._stopped is not None  # in flight: queued or local
                        or self._join_requested or self._stop_requested):
                    return False
                self._in_flight.add(announcement.key)
            self._driving = threading.get_ident()
            try:
                pending = self._cycle_express(route, index, buffer, make_work)
            except BaseException as exc:  # as in any cycle (see _drive_once)
                self._failed(exc)
                raise EngineStoppedError(f"cannot run {announcement.describe()}: {self._stopped}") from exc
            finally:
                self._driving = None
        finally:
            self._driver.release()
        if pending is not None:
            pending.result()
        return True

    def drive(self, work: Work) -> None:
        """Run the engine's cycles on this thread until ``work`` is done: a caller that
        blocks on a collective negotiates and runs it itself, with no hand-off to the
        engine thread and back (which takes over whenever this one sleeps).  The cycles
        are the engine thread's own, so names are matched, works fused, ordered, checked
        and watched exactly as for asynchronous work.  Not from within a cycle (an
        ``execute`` callable), where the work can only be waited for."""
        thread = threading.get_ident()
        if self._driving == thread:
            work.wait()
            return
        call = self._marks(thread)[2]
        announcement = work.announcement
        call.what, call.peers = announcement.describe, announcement.ranks
        call.ident = ("engine", *work.key)  # its needs read the table by it (see _marks)
        with call:
            while not work.done():
                with self._driver:
                    pause = 0.0 if work.done() or self._stopped is not None else self._drive_once()
                if pause is None:  # quiet, yet not done: another driver is finishing it
                    pause = self._config.cycle_time_ms / 1000
                if pause:
                    work.wait(pause)

    def join(self) -> int:
        """Block until every rank has joined; meanwhile contribute zeros to allreduces.
        Returns the last rank to join."""
        with self._lock:
            if self._stopped is not None:
                raise EngineStoppedError(f"cannot join: {self._stopped}")
            if self._gone:  # a join needs every rank, and these will never join
                raise EngineStoppedError(f"cannot join: {_shut_down_by(sorted(self._gone))}")
            self._join_done.clear()
            self._join_requested = True
        self._wake.set()
        # the engine's table reports a join's stall (a wait by design: never fatal)
        with self._watchdog.waiting("a join", f"hvd.join() on rank {self.rank}", self._everyone, ident=("join",),
                                    needs=self._not_joined, stalls=False):
            self._join_done.wait()
        if isinstance(self._join_value, BaseException):
            raise self._join_value
        return self._join_value

    def _not_joined(self) -> list[int]:
        joined = set(self._negotiator.joined)
        return [r for r in self._everyone if r not in joined and r != self.rank]

    def pending_in(self, set_id: int) -> list[str]:
        """Names of this rank's unfinished works on a process set."""
        with self._lock:
            return sorted(name for sid, name in self._in_flight if sid == set_id)

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

    def start_timeline(self, path: str, mark_cycles: bool = False, asked_by: str = "start_timeline()") -> None:
        """Write a timeline to ``path`` (on rank 0; other ranks ignore the call)."""
        if self.rank == 0:
            self.stop_timeline()
            self._timeline = Timeline(path, self.rank, mark_cycles, asked_by)

    def stop_timeline(self) -> None:
        timeline, self._timeline = self._timeline, None
        if timeline is not None:
            timeline.close()

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread: cycles, sleeping between them as each cycle says."""
        while True:
            with self._driver:
                if self._stopped is not None:
                    return
                pause = self._drive_once()
            if pause is None:
                self._sleep_quietly()
            elif pause:
                self._wake.wait(pause)

    def _drive_once(self) -> float | None:
        """One cycle by the thread holding the driver.  Returns what :meth:`_cycle` does, or 0
        once the engine has stopped, should the cycle fail (see :meth:`_failed`)."""
        self._driving = threading.get_ident()
        try:
            return self._cycle()
        except BaseException as exc:
            self._failed(exc)
            return 0.0
        finally:
            self._driving = None

    def _failed(self, exc: BaseException) -> None:
        """A cycle failed: stop the engine and, by default, abort the job (never leave callers
        waiting on a dead engine)."""
        how = f"psrt engine failed: {bootstrap.describe_exception(exc)}"
        logger.exception("psrt: rank %d: %s", self.rank, how)
        self._stop(how)
        if self._config.abort_on_exception and self._world.size > 1:
            bootstrap.abort_job(how)

    def _has_news(self) -> bool:
        """Whether this rank has something to negotiate (read without the lock: a stale
        answer only delays the next look)."""
        return bool(self._queue) or (self._join_requested and not self._join_sent) or \
            (self._stop_requested and not self._stop_sent)

    def _sleep_quietly(self) -> None:
        """While every engine is quiet: wake on this rank's own news, or when another rank
        rings; the doorbell is polled ever more slowly, so idling costs no measurable CPU."""
        nap = _FIRST_QUIET_NAP_S
        while not self._wake.wait(nap):
            nap = min(2 * nap, _LONGEST_QUIET_NAP_S)
            if not self._driver.acquire(blocking=False):
                continue  # a caller drives: it will leave the quiet epoch itself
            try:
                if self._quiet_epoch is None or self._stopped is not None:
                    return
                if self._doorbell.rang(self._quiet_epoch):
                    self._quiet_epoch = None
                    return
            finally:
                self._driver.release()
        # Woken by news of this rank's own: let the burst it starts (a step's gradients)
        # gather until submissions pause for a cycle, so that one round negotiates all of
        # it, and the caller's Python is not slowed by this thread's.  A caller that blocks
        # meanwhile drives at once.
        gather = self._config.cycle_time_ms / 1000
        while (since := time.perf_counter() - self._last_submit) < gather:
            time.sleep(gather - since)

    def _cycle(self) -> float | None:
        """Negotiate once and run what every rank is ready for.  Returns how long to wait
        before the next cycle, or None when every rank's engine is quiet."""
        if self._wake.is_set():
            self._wake.clear()
        with self._lock:
            arrived, self._queue = self._queue, []
            join = self._join_requested and not self._join_sent
            stop = self._stop_requested and not self._stop_sent
        if self._quiet_epoch is not None:
            if not (arrived or join or stop):
                return None
            self._unrung, self._quiet_epoch = self._quiet_epoch, None
        timeline = self._timeline  # read once: stop_timeline() may clear it meanwhile
        if timeline is not None:
            timeline.cycle(time.perf_counter())
        fresh = self._accept(arrived)
        with self._marks(threading.get_ident())[0]:
            result = self._negotiator.round(self._local, fresh, join, stop, self._wait_for_round)
        return self._act(result, join, stop, timeline)

    def _act(self, result: RoundResult, join: bool, stop: bool, timeline: Timeline | None) -> float | None:
        """The rest of a cycle: run and complete what the round decided (see :meth:`_cycle`)."""
        self._join_sent, self._stop_sent = self._join_sent or join, self._stop_sent or stop
        if timeline is not None:  # phases are stamped only for the timeline
            now = time.perf_counter()
            for work in self._local.values():
                if work.negotiated is None:
                    work.negotiated = now
        if result.responses:
            self._execute(result.responses, timeline is not None)
        if result.join_completed is not None:
            self._join_value, self._join_sent = result.join_completed, False
            with self._lock:
                self._join_requested = False
            self._join_done.set()
        self._inspect_stalls()
        if result.shutdown_by:
            if self._shut_down(result.shutdown_by):
                return 0.0
            self._join_sent = False  # a pending join failed: a later one is announced afresh
        if not result.waiting:  # the same on every rank: all go quiet at this round
            self._quiet_epoch = self._negotiator.rounds
            if self._stalls_published:
                self._inspect_stalls(force=True)
            return 0.0 if self._has_news() else None
        if result.responses or self._queue or self._waiting_briefly():
            return 0.0
        return self._config.cycle_time_ms / 1000

    def _cycle_express(self, route: Express, index: int, buffer: torch.Tensor,
                       make_work: Callable[[], Work]) -> Work | None:
        """The cycle of :meth:`express`: when the round shows the allreduce (cache entry
        ``index``) ready everywhere and nothing else going on, it runs on ``buffer`` and every
        rank goes quiet, as after any such round (None is returned); any other outcome is
        acted on as by :meth:`_cycle`, with the work ``make_work`` builds pending here (it is
        returned, to be waited for: it completes in a later cycle, or fails)."""
        if self._quiet_epoch is not None:
            self._unrung, self._quiet_epoch = self._quiet_epoch, None
        fast = self._negotiator.round_alone(index, self._wait_alone)
        announcement = route.announcement
        if fast is not None:
            work = make_work()
            work.cache_index, work.driver = index, self.drive
            self._local[announcement.key] = work
            with self._marks(self._driving)[0]:  # the round's slow path, if any rank asked for it
                result = self._negotiator.complete_round(self._local, *fast, False, False)
            self._act(result, False, False, None)
            return work
        if route.comm is None:
            route.comm = self._data_comm(announcement.reduction.set_id, buffer.device)
            route.describe = functools.partial(self._describe, announcement, 0)
        mark = self._marks(self._driving)[1]
        mark.what, mark.peers = route.describe, announcement.ranks
        with mark:
            route.comm.allreduce(buffer, route.op, route.scale)
        with self._lock:
            self._in_flight.discard(announcement.key)
        if self._autotuner is not None:
            self._autotune(((announcement.key, announcement.reduction.nbytes),))
        self._quiet_epoch = self._negotiator.rounds
        if self.rank == 0:
            self._inspect_stalls(force=self._stalls_published)
        return None

    def _wait_alone(self, request: Request) -> None:
        """Wait for :meth:`_cycle_express`'s round: first by testing it back to back (a
        round of ranks in step needs a few tests, each of which moves it on, and the
        watchdog needs no mark for a wait of microseconds), then as every round waits."""
        for _ in range(_EXPRESS_TESTS):
            if request.test():
                self._unrung = None
                return
        with self._marks(self._driving)[0]:
            self._wait_for_round(request)

    def _marks(self, thread: int) -> tuple[Wait, Wait, Wait]:
        """A driving thread's marks for negotiation rounds, for collectives and for the call
        it is blocked in (a mark serves one thread; the last two say what they are when
        entered).  A call's stall is the engine table's (:meth:`_inspect_stalls`), so the
        call mark serves deadlock detection only."""
        marks = self._thread_marks.get(thread)
        if marks is None:
            call = self._watchdog.waiting("a blocking engine call", "", self._everyone, stalls=False)
            call.needs = lambda: self._negotiator.missing(call.ident[1:])  # the ranks that lack the work
            marks = self._thread_marks[thread] = (
                self._watchdog.waiting("an engine negotiation round", self._describe_round, self._everyone),
                self._watchdog.waiting("an engine collective", "", self._everyone), call)
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
        members = set().union(*(work.announcement.ranks for work in self._local.values()))
        return [rank for rank in self._everyone if rank != self.rank and rank not in members]

    def _describe_round(self) -> str:
        # each tuple() is one step under the GIL: the engine thread and callers change these
        pending = tuple(self._local) + tuple(work.key for work in tuple(self._queue))
        names = ", ".join(repr(name) for _, name in pending[:3]) + (f" and {len(pending) - 3} more"
                                                                   if len(pending) > 3 else "")
        return (f"rank {self.rank}'s engine negotiation round (which collectives every rank is ready to run; "
                f"{'pending here: ' + names if pending else 'nothing pending here'})")

    def _waiting_briefly(self) -> bool:
        """Whether a local work has been waiting for other ranks only a few cycles.

        Rounds are collective, so a rank that sleeps a cycle delays every other
        rank's next round: while its works are likely to become ready soon, a
        rank goes straight to the next round (which waits, without spinning,
        for the others to arrive).  Long waits fall back to one round per cycle.
        """
        recent = time.perf_counter() - _BRIEF_WAIT_CYCLES * self._config.cycle_time_ms / 1000
        return any(work.submitted > recent for work in self._local.values())

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

    # -- execution --------------------------------------------------------------------------
    def _execute(self, responses: list[Response], stamped: bool) -> None:
        if stamped:
            now = time.perf_counter()
            for response in responses:
                work = self._local.get(response.announcement.key)
                if work is not None:
                    work.ready = now
        mark = self._marks(threading.get_ident())[1]
        for batch in fusion.plan(responses, self._config.fusion_threshold):
            mark.what, mark.peers = functools.partial(self._describe_batch, batch), batch.responses[0].announcement.ranks
            with mark:
                if batch.fused:
                    self._allreduce(batch.responses)
                else:
                    self._run_one(batch.responses[0])
        if self._autotuner is not None:
            self._autotune((r.announcement.key, r.announcement.reduction.nbytes) for r in responses
                           if r.announcement.reduction is not None and r.error is None)

    # -- autotuning (see psrt.engine.autotune) ------------------------------------------------
    def _autotune(self, reduced) -> None:
        """Feed the autotuner what was just reduced (the same on every rank) and apply the
        setting it switches to, on every rank at this same response."""
        switch = self._autotuner.observe(reduced)
        if switch is not None:
            self._apply(switch)
        if self._autotuner.done:
            if self.rank == 0:
                logger.warning("psrt: autotuning settled on fusion threshold %d bytes, cycle time %g ms",
                               self._config.fusion_threshold, self._config.cycle_time_ms)
            self._autotuner = None

    def _apply(self, setting: Setting) -> None:
        self._config = dataclasses.replace(self._config, fusion_threshold=setting.fusion_threshold,
                                           cycle_time_ms=setting.cycle_time_ms)

    def _rank0s_score(self, score: float) -> float:
        """Rank 0's score (collective over the world: at the same response on every rank)."""
        value = torch.tensor([score], dtype=torch.float64)
        with self._watchdog.waiting("an autotuning step", "the broadcast of rank 0's score of a fusion setting",
                                    self._everyone):
            self._autotune_comm.broadcast(value, 0).wait()
        return float(value)

    def _describe_batch(self, batch: fusion.Batch) -> str:
        return self._describe(batch.responses[0].announcement, len(batch.responses) - 1)

    def _describe(self, first: Announcement, fused_with: int) -> str:
        more = f" (fused with {fused_with} more)" if fused_with else ""
        return f"rank {self.rank}'s {first.describe()}{more} over ranks {rank_ranges(first.ranks)}"

    def _take(self, response: Response) -> Work | None:
        return self._local.pop(response.announcement.key, None)

    def _allreduce(self, responses: list[Response]) -> None:
        first = responses[0].announcement
        if self.rank not in first.ranks:
            return
        works = [self._take(r) for r in responses]
        # A member without the work has joined: it contributes zeros.
        buffers = [b for w, r in zip(works, responses)
                   for b in (w.buffers if w is not None else r.announcement.reduction.zeros())]
        pieces = [p for r in responses for p in r.announcement.reduction.pieces]
        comm = self._data_comm(first.reduction.set_id, buffers[0].device)
        phases: list[tuple[str, float, float]] = []
        for message in fusion.messages(pieces):
            piece = pieces[message[0]]
            self._reduce_message([buffers[i] for i in message], first.reduction.op, piece.scale,
                                 comm, phases)
        for work in works:
            if work is not None:
                self._finish(work, None, None, phases)

    def _reduce_message(self, buffers: list[torch.Tensor], op: ReduceOp, scale: float,
                        comm: Communicator, phases: list[tuple[str, float, float]]) -> None:
        """One allreduce carrying ``buffers``: in place when they are one tensor or lie back
        to back, else packed into the fusion buffer and unpacked after."""
        start = time.perf_counter()
        flat = buffers[0] if len(buffers) == 1 else fusion.contiguous_span(buffers)  # any shape: a flat array
        staged = flat is None
        if staged:
            flat = self._fusion.get(buffers[0].dtype, buffers[0].device, sum(b.numel() for b in buffers))
            fusion.pack(buffers, flat)
        packed = time.perf_counter()
        comm.allreduce(flat, op, scale)
        reduced = time.perf_counter()
        if staged:
            fusion.unpack(flat, buffers)
            end = time.perf_counter()
            phases += [("MEMCPY_IN_FUSION_BUFFER", start, packed), ("ALLREDUCE", packed, reduced),
                       ("MEMCPY_OUT_FUSION_BUFFER", reduced, end)]
        else:
            phases.append(("ALLREDUCE", start, reduced))

    def _run_one(self, response: Response) -> None:
        work = self._take(response)
        if work is None:
            return
        if response.error is not None:
            self._finish(work, None, CollectiveMismatchError(response.error), ())
            return
        set_id = work.announcement.key[0]
        host = self._host_comm(set_id)
        data = self._data_comm(set_id, work.device)
        start = time.perf_counter()
        value = work.execute(host, data)
        self._finish(work, value, None, ((work.announcement.collective.upper(), start, time.perf_counter()),))

    def _host_comm(self, set_id: int) -> Communicator:
        return self._topology.communicator(self._topology.process_set(set_id))

    def _data_comm(self, set_id: int, device: torch.device) -> Communicator:
        """Looked up once per set and device (set ids are never reused)."""
        comm = self._data_comms.get((set_id, device))
        if comm is None:
            comm = self._data_comms[(set_id, device)] = self._topology.transport(
                self._topology.process_set(set_id), device)
        return comm

    def _finish(self, work: Work, value: object, error: BaseException | None,
                phases: tuple) -> None:
        with self._lock:
            self._in_flight.discard(work.key)
        timeline = self._timeline  # read once: stop_timeline() may clear it meanwhile
        if timeline is not None:
            _record(timeline, work, phases)
        if error is None:
            work.complete(value)
        else:
            work.fail(error)

    # -- stalls and stopping ----------------------------------------------------------------------
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


def _record(timeline: Timeline, work: Work, phases: tuple) -> None:
    """A completed work's phases on the timeline."""
    negotiated = work.negotiated or work.submitted
    ready = work.ready or negotiated
    start = phases[0][1] if phases else ready
    timeline.phase(work.name, "NEGOTIATE", work.submitted, negotiated)
    timeline.phase(work.name, "WAIT_FOR_OTHER_RANKS", negotiated, ready)
    timeline.phase(work.name, "QUEUE", ready, start)
    for phase, begin, end in phases:
        timeline.phase(work.name, phase, begin, end)



