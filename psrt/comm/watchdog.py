"""Stall reports for every wait in psrt on other ranks, naming the rank to blame.

Each place where psrt waits on other ranks marks the wait (a :class:`~psrt.comm.waits.Wait`)
with :meth:`Watchdog.waiting`:
the engine thread's negotiation rounds and collectives, tensor- and pipeline-parallel
traffic on the caller's thread, a worker's requests to parameter servers, start-up.
Loops that hold requests instead of blocking in them (a parameter server; the engine's
table of collectives some ranks have not submitted) :meth:`~Watchdog.publish` what they
hold.  The caller waits in MPI as usual: marking costs a dictionary write, nothing polls.

A daemon thread per rank looks four times a second.  A wait older than
``PSRT_STALL_CHECK_TIME`` is *probed*: the watchdog asks the ranks it waits on what
they are doing, over a communicator of its own (:mod:`psrt.comm.prober`).  A rank that is
stopped, hung with the GIL held, or cut off by the network cannot answer; one that
answers says what it waits for itself, or that it waits for nothing in psrt (it is
busy in its own code).  So the report names the rank to blame, not only the one that
noticed.  Probing has steps, so that a stall of a thousand ranks costs no thousand
squared messages: a stalled rank first asks rank 0 and the ranks 1, 2, 4, 8, ... below
it, and speaks for the job only if none of them is stalled too (one frozen rank among
many gives one report); only the rank that speaks then asks the ranks it waits on, and
the ranks those wait for in turn (:mod:`psrt.comm.stall_report` writes what they said).  A
wait older than ``PSRT_STALL_SHUTDOWN_TIME`` ends the job with its report, which psrun
prints as the failure; a rank that does not speak ends it itself only if nobody has by
then, a check period later.  A wait that is one by design (a join) is reported, never
fatal: past the shutdown time a busy rank cannot be told from a stuck one (a node stuck
in I/O answers probes), but a join's imbalance is the user's data, not a fault.

A deadlock needs no waiting to be sure of: the main thread's blocked *call* (a wait with an
identity) is compared with the other ranks' calls a second after it began (a parameter
server says, of each worker's request it holds, which workers it waits for:
:meth:`Watchdog.hold`), and a deadlock ends the job at once (:mod:`psrt.comm.deadlock`),
unless it is a mismatch of a direct group's calls agreed on once, which
:mod:`psrt.comm.breaker` ends with the same error on every member instead.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from launcher.contract import rank_name
from psrt.comm import callsite, deadlock, stall_report
from psrt.comm.breaker import Breaker
from psrt.comm.prober import Prober
from psrt.comm.ranks import rank_ranges
from psrt.comm.waits import Ranks, Text, Wait, WaitStack, describe

logger = logging.getLogger("psrt")

LOOK_EVERY_S = 0.25
# How long a probed rank has to answer: its watchdog looks every LOOK_EVERY_S, and on an
# oversubscribed host it may wait for a core.
ANSWER_WITHIN_S = 2.0
_MAX_REPORTED_WAITS = stall_report.MAX_SHOWN  # of a probed rank's own waits, in its answer
_MAX_REPORTED_PEERS = 16  # of the ranks each of those waits for
# A probed rank mentions only waits this old (or half the check time, if shorter): the
# engine thread is in some negotiation round almost all the time, each lasting milliseconds.
_LASTING_S = 1.0
_MAX_TEXT = 400

_MAIN_THREAD = threading.main_thread().ident


def combined(kind: str, waits: Sequence[Wait], key: object, ends_job: bool = True, prefix: str = "") -> list[Wait]:
    """One wait standing for all of ``waits`` (what one loop holds): since the oldest, the
    first three described (after ``prefix``) and the rest counted, on every rank any of them
    waits on.  So a stall of a model's hundred gradients is one report and one probe."""
    if not waits:
        return []
    ordered = sorted(waits, key=lambda w: w.since)
    text = prefix + "; ".join(w.describe() for w in ordered[:3]) + (f"; and {len(ordered) - 3} more"
                                                                  if len(ordered) > 3 else "")
    peers = tuple(sorted({r for w in ordered for r in w.peer_ranks()}))
    return [Wait(kind, text, peers, ordered[0].since, key, ends_job=ends_job)]


@dataclass
class _StallProbe:
    """The latest probe about one stalled wait: when each target was asked; and the answers of
    the last probe that settled (a deadlock's probe is :mod:`psrt.comm.deadlock`'s own)."""

    asked: dict[int, float]
    started: float
    settled: bool = False
    heard: dict[int, dict] | None = None


class Watchdog:
    """Watches this rank's waits on other ranks; see the module docstring."""

    def __init__(self, check_s: float, shutdown_s: float, end_job: Callable[[str], None], *,
                 rank: int = 0, name_rank: Callable[[int], str] | None = None) -> None:
        self._check_s, self._shutdown_s, self._end_job = check_s, shutdown_s, end_job
        self.rank = rank
        self._name_rank = name_rank or rank_name
        self._world_to_job: Sequence[int] | None = None
        self._prober: Prober | None = None
        self._stacks: dict[int, WaitStack] = {}  # thread id -> its waits, innermost last
        self._local = threading.local()
        self._published: dict[str, tuple[Wait, ...]] = {}
        self._holds: Callable[[], list | None] | None = None  # see hold()
        self._probes: dict[object, _StallProbe] = {}
        self._asked_at: dict[int, float] = {}  # when each rank was last pinged
        self._reported: set[object] = set()
        # Who speaks while no probe is possible (start-up); see bootstrap.Arrivals.speaks.
        self.speaks_unprobed: Callable[[], bool] = lambda: self.rank == 0
        self._detector: deadlock.Detector | None = None  # made with the prober
        self.breaker = Breaker()  # the direct groups made with this watchdog register with it
        self._deadlock_reported = False
        self._ended = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="psrt-watchdog", daemon=True)
        self._thread.start()

    # -- set-up ---------------------------------------------------------------------------------
    def attach(self, prober: Prober) -> None:
        """Start probing through ``prober`` (made once every rank has started)."""
        self._prober, self.rank = prober, prober.rank
        self._detector = deadlock.Detector(prober.rank, ANSWER_WITHIN_S)

    def name_ranks(self, name_rank: Callable[[int], str], world_to_job: Sequence[int]) -> None:
        """Parameter-server mode: how to name a job rank in reports, and the job rank of each
        rank of psrt's world (the workers), which is how callers name their peers."""
        self._name_rank, self._world_to_job = name_rank, tuple(world_to_job)

    def job_ranks(self, world_ranks: Iterable[int]) -> tuple[int, ...]:
        mapping = self._world_to_job
        return tuple(world_ranks) if mapping is None else tuple(mapping[r] for r in world_ranks)

    # -- what callers mark ------------------------------------------------------------------------
    def waiting(self, kind: str, what: Text, world_peers: Ranks = (), *, job_peers: Ranks = (),
                ident: tuple | None = None, needs: Callable[[], Sequence[int] | None] | None = None,
                stalls: bool = True) -> Wait:
        """Mark the calling thread as waiting on other ranks for ``what`` (a string, or a
        function evaluated only if the wait becomes a stall) until the block ends.

        The ranks waited on are given as psrt world ranks (``world_peers``) or, for
        parameter-server traffic, job ranks (``job_peers``); either may be a function.
        The returned wait may be entered again and again by the thread that made it (the
        engine thread keeps one for all its negotiation rounds), never by another thread.
        ``ident`` and ``needs`` make it a call (see :class:`Wait`); ``stalls=False`` leaves its
        stall to another wait that reports it (the engine's table of works some ranks lack).
        """
        try:
            stack = self._local.stack
        except AttributeError:
            stack = self._local.stack = self._stacks.setdefault(threading.get_ident(), WaitStack())
        if world_peers:
            wait = Wait(kind, what, world_peers, 0.0, None, self.job_ranks, stack, ident=ident, needs=needs)
        else:
            wait = Wait(kind, what, job_peers, 0.0, None, None, stack, ident=ident, needs=needs)
        wait.stalls = stalls
        return wait

    def hold(self, holds: Callable[[], list | None] | None) -> None:
        """This rank holds other ranks' requests (a parameter server): ``holds`` says what each
        one waits for, as ``[rank, request, [ranks it waits for]]`` entries, or None when it
        cannot tell now; probe answers carry it for deadlock detection (see
        :func:`psrt.comm.deadlock.resolve_held`).  It is called on the watching thread."""
        self._holds = holds

    def publish(self, source: str, waits: Sequence[Wait]) -> None:
        """Replace what ``source`` (a loop on this rank) holds; each wait's ``key`` must stay
        the same while it lasts.  Peers of published waits are job ranks."""
        self._published[source] = tuple(waits)

    def stop(self) -> None:
        """End the watching thread and close the prober (at shutdown)."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self._prober is not None:
            self._prober.close()
            self._prober = None

    # -- the watching thread -------------------------------------------------------------------------
    def _current(self) -> list[Wait]:
        waits = []
        for stack in list(self._stacks.values()):
            try:
                innermost = stack[-1]  # the innermost wait says most
            except IndexError:
                continue
            if innermost.stalls:
                waits.append(innermost)
        for published in list(self._published.values()):
            waits.extend(published)
        return waits

    def status(self) -> dict:
        """What this rank tells a rank that probes it: how long its oldest wait has lasted,
        its first waits, the call its main thread is blocked in (or else where that thread
        is), the last call it left, and what it holds for other ranks (see :meth:`hold`)."""
        now = time.monotonic()
        lasting = min(_LASTING_S, self._check_s / 2)
        waits = sorted((w for w in self._current() if now - w.since >= lasting), key=lambda w: w.since)
        call = self.main_call(now)
        status = {"oldest": round(now - waits[0].since, 1) if waits else 0.0,
                  "waits": [[w.kind, w.describe()[:_MAX_TEXT], list(w.peer_ranks()[:_MAX_REPORTED_PEERS])]
                            for w in waits[:_MAX_REPORTED_WAITS]],
                  "call": None if call is None else call.to_status()}
        if self._holds is not None:
            status["holds"] = self._holds()
        breaking = self.breaker.status()
        if breaking is not None:
            status["breaking"] = breaking
        if call is None:
            status["at"] = callsite.locate(_MAIN_THREAD)[0]
        last = self._stacks.get(_MAIN_THREAD, WaitStack()).last
        if last is not None:
            status["last"] = describe(last[1], last[0])[:_MAX_TEXT]
        return status

    def main_call(self, now: float, lasting: float = 0.0) -> deadlock.Call | None:
        """The call the main thread is blocked in (its innermost wait with an identity), if
        it has lasted ``lasting`` seconds (where its user is looked up only then)."""
        stack = self._stacks.get(_MAIN_THREAD)
        wait = next((w for w in reversed(tuple(stack or ())) if w.ident is not None), None)
        if wait is None or now - wait.since < lasting:
            return None
        needs = None if wait.needs is None else wait.needed_ranks()
        site, api = callsite.locate(_MAIN_THREAD)
        return deadlock.Call(self.rank, wait.ident, wait.since, now - wait.since, wait.peer_ranks(), needs,
                             wait.needs is None or needs is not None, wait.describe()[:_MAX_TEXT], site, api,
                             deadlock.collective(wait.ident))

    def _watch(self) -> None:
        while not self._stopping.wait(LOOK_EVERY_S):
            try:
                self._look()
            except Exception:  # the watchdog must outlive any bug in a description
                logger.exception("psrt: the stall watchdog failed to look")

    def _look(self) -> None:
        prober = self._prober
        if prober is not None:
            prober.serve(self.status)
        now = time.monotonic()
        if prober is not None and not self._ended:
            self._look_for_deadlock(now, prober)
        current = self._current()
        live = {self._key(w) for w in current}
        self._probes = {k: p for k, p in self._probes.items() if k[1] in live}  # k: (step, the wait's key)
        self._reported &= live
        for wait in current:
            waited = now - wait.since
            if waited >= self._check_s and not self._ended:
                self._inspect(wait, waited, now, prober)

    def _look_for_deadlock(self, now: float, prober: Prober) -> None:
        """End the job at once if the main thread's call is part of a deadlock (see
        :mod:`psrt.comm.deadlock`), with a line per rank saying what it waits in and where."""
        found = self._detector.look(self.main_call(now, lasting=deadlock.AFTER_S), now, prober)
        if found is not None and self.breaker.take(self.rank, *found, now):
            found = None
        found = self.breaker.step(now, prober) or found  # a mismatch not ended in time is reported
        if found is None or self._deadlock_reported:
            return
        ranks, calls = found
        for line in deadlock.report(ranks, calls, self._name_rank):
            print(f"psrt: deadlock: {line}", file=sys.__stderr__, flush=True)
        if self._shutdown_s <= 0:  # PSRT_STALL_SHUTDOWN_TIME=0: report, never end (a debugger may attach)
            self._deadlock_reported = True
            return
        self._ended = True
        shown = "; ".join(f"{self._name_rank(r)} in {calls[r].what}" for r in ranks[:3]) + (
            f"; and {len(ranks) - 3} more" if len(ranks) > 3 else "")
        self._end_job(f"deadlock: ranks {rank_ranges(ranks)} each wait in a psrt call that cannot complete "
                      f"({shown}); each rank's call site is named above")

    @staticmethod
    def _key(wait: Wait) -> object:
        return wait.key if wait.key is not None else (id(wait), wait.since)

    def _inspect(self, wait: Wait, waited: float, now: float, prober: Prober | None) -> None:
        key = self._key(wait)
        late = self._shutdown_s > 0 and waited >= self._shutdown_s + self._check_s
        peers_further: list[int] = []
        if prober is None:
            speaks, heard, peers = self.speaks_unprobed(), {}, []
        else:
            # Step one: does a lower rank speak for the job?
            verdict = self._probe(("decide", key), self._deciders(), now, prober)
            if verdict is None:
                return  # answers are still on their way
            speaks = not any(status["oldest"] >= self._check_s / 2 for status in verdict.values())
            if not (speaks or late):
                return
            # Step two, for the rank that speaks: what do the ranks waited on say?
            peers = [r for r in wait.peer_ranks() if r != self.rank]
            heard = self._probe(("peers", key), peers, now, prober)
            if heard is None:
                return
            # Step three: the ranks those wait for in turn (a worker waits for its server, which
            # waits for a frozen worker): the rank to blame may be one further.
            further = stall_report.beyond(self.rank, peers, heard)
            heard_further = self._probe(("beyond", key), further, now, prober) if further else {}
            if heard_further is None:
                return
            heard = {**heard_further, **heard}
            peers_further = [r for r in further if r not in heard_further or not stall_report.busy(heard_further[r])]
        name = self._name_rank
        report = (f"stall: {wait.describe()} has waited {waited:.0f} s" + stall_report.peers_text(peers, heard, name)
                  + stall_report.beyond_text(peers_further, peers, heard, name))
        if wait.ends_job and self._shutdown_s > 0 and waited >= self._shutdown_s and (speaks or late):
            self._ended = True
            blame = (stall_report.blame_line(self.rank, peers, heard, wait.describe(), waited, name)
                     or stall_report.blame_line(self.rank, peers_further, heard, wait.describe(), waited, name))
            if blame is not None:  # psrun headlines the rank blamed
                print(blame, file=sys.__stderr__, flush=True)
            self._end_job(f"{report} (PSRT_STALL_SHUTDOWN_TIME={self._shutdown_s:g} s)")
        elif speaks and key not in self._reported:
            self._reported.add(key)
            logger.warning("psrt: %s", report)

    def _deciders(self) -> tuple[int, ...]:
        """The lower ranks a stalled rank asks before speaking: 0 and the powers of two below
        it, so that the lowest stalled rank speaks while each asks only log2(size) ranks."""
        lower, power = {0}, 1
        while power < self.rank:
            lower.add(power)
            power *= 2
        return tuple(sorted(lower - {self.rank}))

    def _probe(self, key: object, targets: Sequence[int], now: float, prober: Prober) -> dict[int, dict] | None:
        """What ``targets`` answered: probes again every check period (a rank another probe
        asked in this period is not asked again: its answer, or its silence, counts),
        reporting from the last settled probe meanwhile; None until the first one settles."""
        period = max(self._check_s, 2 * ANSWER_WITHIN_S)
        probe = self._probes.get(key)
        if probe is None or (probe.settled and now - probe.started >= period):
            fresh = [r for r in targets if now - self._asked_at.get(r, -1e18) >= period]
            prober.ask(fresh)
            self._asked_at.update((r, now) for r in fresh)
            probe = self._probes[key] = _StallProbe({r: self._asked_at[r] for r in targets}, now,
                                               heard=None if probe is None else probe.heard)
        if not probe.settled:
            answers = {r: status for r, (at, status) in prober.answers().items()
                       if r in probe.asked and at >= probe.asked[r]}
            if all(r in answers or now - asked >= ANSWER_WITHIN_S for r, asked in probe.asked.items()):
                probe.settled, probe.heard = True, answers
        return probe.heard
