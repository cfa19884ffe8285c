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

The engine is three parts, one module each: this one holds the state they share and the
caller-driven path (queueing, a blocking caller driving the cycles, the express path,
join); :mod:`psrt.engine.executor` the cycle (negotiation results, fusion,
communication); :mod:`psrt.engine.supervisor` stall reports, failure and shutdown.
"""
from __future__ import annotations

import functools
import threading
import time
from typing import Callable

import torch

from psrt.comm.base import Communicator, Request
from psrt.comm.watchdog import Wait, Watchdog
from psrt.config import Config
from psrt.engine import fusion
from psrt.engine.autotune import Autotuner, Setting
from psrt.engine.doorbell import Doorbell
from psrt.engine.executor import Executor
from psrt.engine.negotiation import Negotiator
from psrt.engine.supervisor import Supervisor, _shut_down_by
from psrt.engine.timeline import Timeline
from psrt.engine.work import Express, Work, WorkKey
from psrt.errors import EngineStoppedError, InvalidArgumentError

# A work still waiting for other ranks after this long is announced through the
# slow path, so that the shared table (and the stall report) knows of it.
_REPORT_AFTER_S = 1.0
# How often Engine.express tests its round before waiting as every round does (with a
# watchdog mark, spinning and then napping): a test takes well under a microsecond.
_EXPRESS_TESTS = 64


class Engine(Executor, Supervisor):
    """One rank's engine: the state its three parts share, and the caller-driven path.

    The caller's side is here: queueing works (:meth:`submit`), running a blocking one on the
    caller's thread (:meth:`run`, :meth:`drive`), the express path of a lone cached allreduce
    (:meth:`express`) and :meth:`join`.  The background cycle is the executor's
    (:mod:`psrt.engine.executor`); stall reports, failure and shutdown are the supervisor's
    (:mod:`psrt.engine.supervisor`)."""

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
