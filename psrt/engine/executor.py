"""The engine's executor: the cycle that turns negotiation results into communication.

A cycle drains what callers queued, negotiates with the other ranks (see
:mod:`psrt.engine.negotiation`) which works are ready on every member of their process
set, and runs those in the agreed order, allreduces fused into as few messages as the
fusion threshold allows (:mod:`psrt.engine.fusion`), recording phases on the timeline and
feeding the autotuner.  Whoever holds the driver runs it: the engine thread (:meth:`_run`,
sleeping quietly between bursts) or a caller blocked on a collective (see
:mod:`psrt.engine.engine`).  Stopping, failure and stall reports are the supervisor's
(:mod:`psrt.engine.supervisor`).

:class:`Executor` is one part of :class:`psrt.engine.Engine`, which builds the state it
works on (queue, pending works, communicators, marks) and holds the parts together.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time

import torch

from psrt.comm import poll
from psrt.comm.base import Communicator, ReduceOp, Request
from psrt.comm.ranks import rank_ranges
from psrt.comm.watchdog import Wait
from psrt.engine import fusion
from psrt.engine.autotune import Setting
from psrt.engine.negotiation import Response, RoundResult
from psrt.engine.timeline import Timeline
from psrt.engine.work import Announcement, Work
from psrt.errors import CollectiveMismatchError

logger = logging.getLogger("psrt")

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


class Executor:
    """The background cycle (see the module's docstring).

    Works on the state :class:`~psrt.engine.Engine` builds; of the other parts it calls the
    supervisor's ``_failed`` (a cycle raised), ``_inspect_stalls`` and ``_shut_down`` (a
    round reported ranks shutting down)."""

    # -- timeline -----------------------------------------------------------------------------
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
