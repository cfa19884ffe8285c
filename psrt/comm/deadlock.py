"""Deadlock: ranks blocked in psrt calls that can never complete, told apart from a stall.

A stall is a rank waiting for another that may still come (it computes, or it is slow);
only time can tell, so a stall is reported after ``PSRT_STALL_CHECK_TIME``.  A deadlock
needs no waiting to be sure of: rank 0 waits in a broadcast that rank 1 never joins
because rank 1 waits in a reduce-scatter that rank 0 never joins.  Each rank's
watchdog answers probes with the call its main thread is blocked in (:class:`Call`:
what it is, an identity every rank gives the same collective, the ranks it still needs,
where the user called it), and :func:`find` decides from those answers alone.

The rule.  Rank r *needs* rank q when r's call cannot complete until q does something:
q has not submitted r's engine collective (the engine's table says so), or q is not in
r's direct collective (and not past it), or r waits for q's message.  A needed rank
that is not blocked may still come; a needed rank that is blocked comes only once its
own call completes.  So the ranks that can reach a cycle of "needs a blocked rank"
edges are deadlocked: none of them can move, whatever the others do.

A call can also be *held*: a worker's request that a parameter server keeps until other
workers act (a sync pull until their pushes arrive, a save until they ask too).  Its
identity names the requests (:data:`HELD`), and only their holders know whom each one waits
for: they answer probes with a table of what they hold (``"holds"``), and
:func:`resolve_held` turns a held call's requests into the ranks it needs.  A request its
holder does not hold needs nobody (it is being answered, or still on its way), and a holder
that cannot say (silent, or busy) adds no need: so a worker waiting on a server that is
only slow is never part of a deadlock.

What it assumes: a rank whose main thread is blocked in psrt makes no other psrt call
meanwhile (from another thread).  Calls made only from other threads are never taken
for blocked, so they are left to the stall report.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from launcher.contract import rank_name
from psrt.comm.ranks import rank_ranges

NameRank = Callable[[int], str]

#: Identities of calls that a rank can be *past*: ("direct", group, sequence number).
DIRECT = "direct"
#: Identities of receives: ("recv", ...), calls that are no collective.
RECEIVE = "recv"
#: Identities of requests held by other ranks: ("held", holder, request, holder, request, ...),
#: the holders' job ranks and the numbers by which they know each request of this rank.
HELD = "held"


def collective(ident: tuple) -> bool:
    """Whether a call of this identity is a collective (what its report tells the user)."""
    return ident[0] not in (RECEIVE, HELD)


@dataclass(frozen=True)
class Call:
    """The call a rank's main thread is blocked in, as its probe answer gives it."""

    rank: int
    ident: tuple  # the same on every rank for the same collective
    since: float  # on that rank's own clock: the same in two answers means the same wait
    age: float  # seconds blocked
    peers: tuple[int, ...]  # the job ranks the call is over
    needs: tuple[int, ...] | None  # job ranks still needed, if the call knows (else: derived)
    known: bool  # False: the call cannot yet tell whom it needs (never a deadlock through it)
    what: str
    site: str  # the user's line that made the call
    api: str  # the psrt function called there, e.g. "ZeroOptimizer.save"
    collective: bool

    @classmethod
    def from_status(cls, rank: int, call: Mapping) -> Call:
        needs = call.get("needs")
        return cls(rank, tuple(call["ident"]), call["since"], call["age"], tuple(call["peers"]),
                   None if needs is None else tuple(needs), call.get("known", True), call["what"],
                   call.get("site", ""), call.get("api", ""), call.get("collective", True))

    def to_status(self) -> dict:
        return {"ident": list(self.ident), "since": self.since, "age": round(self.age, 3), "peers": list(self.peers),
                "needs": None if self.needs is None else list(self.needs), "known": self.known, "what": self.what,
                "site": self.site, "api": self.api, "collective": self.collective}

    def passed_by(self, other: Call) -> bool:
        """Whether ``other``, made by another member, is this same collective or one after it
        on the same direct group (then that member has done its part of this one)."""
        if other.ident == self.ident:
            return True
        return (self.ident[0] == DIRECT and other.ident[:2] == self.ident[:2]
                and other.ident[2] > self.ident[2])

    def describe(self, name_rank: NameRank = rank_name) -> str:
        """``rank 0 waits in <what>, called at train.py:31 (in main)``, with a hint."""
        text = f"{name_rank(self.rank)} waits in {self.what}"
        if self.site:
            text += f", called at {self.site}"
        if self.collective:
            called = f"{self.api}()" if self.api and not self.api.split(".")[-1].startswith("_") else "this psrt call"
            text += (f" ({called} is collective: call it on every rank of ranks {rank_ranges(self.peers)}, "
                     "in the same order)")
        return text


def needed(call: Call, calls: Mapping[int, Call]) -> set[int] | None:
    """The ranks ``call`` still needs (those it names, else its members), less those that are
    in it or past it; None when it cannot tell yet.  A rank in the same call is never needed,
    whatever the call's own list says: that list (the engine's table, the ranks shut down)
    stops changing when a rank freezes, and must not make the ranks waiting alike look stuck
    on each other (the frozen rank, silent, is then left to the stall report)."""
    if not call.known:
        return None
    candidates = call.peers if call.needs is None else call.needs
    return {q for q in candidates if q != call.rank and not (q in calls and call.passed_by(calls[q]))}


def find(me: int, calls: Mapping[int, Call]) -> list[int] | None:
    """The deadlocked ranks this rank is one of (sorted), or None: every rank reachable from
    ``me`` by "needs a blocked rank" edges, when a cycle is among them."""
    if me not in calls:
        return None
    edges = {}
    for rank, call in calls.items():
        needs = needed(call, calls)
        edges[rank] = sorted(q for q in needs or () if q in calls)
    reachable, stack = {me}, [me]
    while stack:
        rank = stack.pop()
        for q in edges[rank]:
            if q not in reachable:
                reachable.add(q)
                stack.append(q)
    return sorted(reachable) if _has_cycle(reachable, edges) else None


def _has_cycle(nodes: set[int], edges: Mapping[int, Sequence[int]]) -> bool:
    """Whether the graph restricted to ``nodes`` has a cycle (iterative depth-first search)."""
    state: dict[int, int] = {}  # 1: on the current path, 2: done
    for start in nodes:
        if start in state:
            continue
        path = [(start, iter(edges[start]))]
        state[start] = 1
        while path:
            node, successors = path[-1]
            for q in successors:
                if q not in nodes:
                    continue
                if state.get(q) == 1:
                    return True
                if q not in state:
                    state[q] = 1
                    path.append((q, iter(edges[q])))
                    break
            else:
                state[node] = 2
                path.pop()
    return False


def signature(ranks: Sequence[int], calls: Mapping[int, Call]) -> tuple:
    """What must be unchanged in the next probe for a deadlock to be confirmed: each rank's
    call and when it began."""
    return tuple((r, calls[r].ident, calls[r].since) for r in ranks)


def report(ranks: Sequence[int], calls: Mapping[int, Call], name_rank: NameRank = rank_name) -> list[str]:
    """The lines that describe a deadlock, a rank each (``name_rank`` names a job rank)."""
    return [calls[r].describe(name_rank) + _needs_text(calls[r], calls, name_rank) for r in ranks]


def _needs_text(call: Call, calls: Mapping[int, Call], name_rank: NameRank) -> str:
    stuck = sorted(q for q in needed(call, calls) or () if q in calls)
    if not stuck:
        return ""
    blocked = f"{_names(stuck, name_rank)}, blocked elsewhere"
    if call.ident[0] == HELD:
        holders = sorted(set(call.ident[1::2]))
        one = len(holders) == 1
        return f"; it waits on {_names(holders, name_rank)}, which hold{'s' if one else ''} it for {blocked}"
    return f"; it needs {blocked}"


def _names(ranks: Sequence[int], name_rank: NameRank) -> str:
    """``rank 1 (worker 1)``, ``rank 0 (worker 0) and rank 2 (worker 2)``; ``ranks 0-5`` for
    more than three."""
    if len(ranks) > 3:
        return f"ranks {rank_ranges(ranks)}"
    named = [name_rank(r) for r in ranks]
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"


def resolve_held(calls: Mapping[int, Call], heard: Mapping[int, Mapping]) -> dict[int, Call]:
    """``calls`` with each held call's needs as its holders' answers (``heard``) tell them:
    every rank any of its requests waits for.  A holder that did not answer, or could not say
    (its table is None), adds nobody: a deadlock is only ever found from what is known."""
    resolved = dict(calls)
    for rank, call in calls.items():
        if call.ident[0] != HELD:
            continue
        needs: set[int] = set()
        for holder, request in zip(call.ident[1::2], call.ident[2::2]):
            table = (heard.get(holder) or {}).get("holds") or ()
            needs.update(q for who, number, waits_for in table if (who, number) == (rank, request)
                         for q in waits_for)
        resolved[rank] = replace(call, needs=tuple(sorted(needs)))
    return resolved


#: A call blocked this long is probed for a deadlock; probes repeat every PERIOD_S at
#: first, then ever more slowly (a quarter of the call's age), so that a long wait for a
#: slow rank costs few messages.  The rank whose block closed a cycle is the one blocked
#: most recently, and it probes at the fast pace.
AFTER_S = 1.0
PERIOD_S = 0.5


@dataclass
class _Probe:
    started: float
    asked: dict[int, float]
    heard: dict[int, Mapping]
    settled: bool = False


class Detector:
    """Probes for one rank: for the call its main thread is blocked in, asks the ranks the
    call needs what they are blocked in, and the ranks those need in turn, until no new rank
    comes up; a deadlock (:func:`find`) found alike in two probes in a row is confirmed."""

    def __init__(self, rank: int, answer_within_s: float) -> None:
        self.rank = rank
        self._answer_within_s = answer_within_s
        self._probe: _Probe | None = None
        self._last_found: tuple | None = None  # the signature of the last probe's deadlock
        self._found_in_a_row = 0  # in how many probes in a row it was found

    def look(self, call: Call | None, now: float, prober) -> tuple[list[int], dict[int, Call]] | None:
        """Move the probe on; returns the deadlocked ranks and their calls once confirmed."""
        if call is None or call.age < AFTER_S or not call.known:
            self._probe = self._last_found = None
            return None
        probe = self._probe
        if probe is None or (probe.settled and now - probe.started >= max(PERIOD_S, call.age / 4)):
            probe = self._probe = _Probe(now, {}, {})
            self._ask(probe, _candidates(call), now, prober)
        if probe.settled:
            return None
        answers = prober.answers()
        for rank, asked in list(probe.asked.items()):
            answer = answers.get(rank)
            if rank not in probe.heard and answer is not None and answer[0] >= asked:
                probe.heard[rank] = answer[1]
                theirs = answer[1].get("call")
                if theirs is not None:
                    self._ask(probe, _candidates(Call.from_status(rank, theirs)), now, prober)
                for _, _, waits_for in answer[1].get("holds") or ():  # a holder: whom its requests need
                    self._ask(probe, waits_for, now, prober)
        if not all(r in probe.heard or now - at >= self._answer_within_s for r, at in probe.asked.items()):
            return None
        probe.settled = True
        calls = {r: Call.from_status(r, status["call"]) for r, status in probe.heard.items() if status.get("call")}
        calls[self.rank] = call
        calls = resolve_held(calls, probe.heard)
        ranks = find(self.rank, calls)
        mark = None if ranks is None else signature(ranks, calls)
        self._found_in_a_row = self._found_in_a_row + 1 if mark is not None and mark == self._last_found else 1
        self._last_found = mark
        if mark is None:
            return None
        # Found alike again: confirmed.  The lowest rank speaks; the others give it one
        # more probe's time, so that one report, not one per rank, is printed.
        return (ranks, calls) if self._found_in_a_row >= (2 if self.rank == ranks[0] else 3) else None

    def _ask(self, probe: _Probe, ranks: Sequence[int], now: float, prober) -> None:
        fresh = [r for r in ranks if r != self.rank and r not in probe.asked]
        if fresh:
            prober.ask(fresh)
            probe.asked.update((r, now) for r in fresh)


def _candidates(call: Call) -> tuple[int, ...]:
    """The ranks a call may need: those it names, else every member (a held call's members
    are its holders, which say whom its requests need)."""
    if not call.known:
        return ()
    return call.needs if call.needs is not None else call.peers
