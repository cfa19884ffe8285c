"""Ending the deadlock of a mismatch between calls agreed on once, with the same
:class:`~psrt.errors.CollectiveMismatchError` on every member.

A direct group's calls checked once (:mod:`psrt.comm.keyed`) run on channels of their own,
so members that make different calls block on different channels, at the same collective
of the group, and the watchdog's deadlock detection (:mod:`psrt.comm.deadlock`) finds them
a second or two later.  Where every rank in that deadlock is a member of one group, blocked
in that group's same collective on a path this module can join (a channel, or the
agreement check), the watchdog hands it here instead of ending the job:

1. Each member marks its blocked call failed, with a message made from the deadlock's
   calls alone (so the same on every member: the ranks, what each called and where), and
   says so in its answers to probes (``"breaking": [group, collective]``).
2. Each member then joins, in the order of their paths (the same on every member), the
   collective of each path it is not blocked on, with buffers of that path's key; but only
   once every member blocked on that path has said it is breaking.  So a member's blocked
   collective completes only after its own call was marked failed: it raises, never returns
   what the dummy buffers gave it.  Joining in one order cannot block: the first path's
   collective has every other member joining it first, and so on.
3. A member raises once it has joined every other path (:meth:`KnownCalls.after`), so no
   member leaves another blocked.

A deadlock not of that shape, or one not ended within :data:`BREAK_WITHIN_S` (a member that
never confirms it), is reported and ends the job as any other.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from psrt.comm.deadlock import DIRECT, Call
from psrt.comm.keyed import CHECK, KnownCalls

logger = logging.getLogger("psrt")

BREAK_WITHIN_S = 10.0


@dataclass
class _Break:
    """One mismatch being ended on this rank: ``targets[path]`` are the ranks blocked on a path
    this rank joins."""

    known: KnownCalls
    ident: list  # [group, collective number], as probe answers carry it
    targets: dict[int, tuple[int, ...]]
    found: tuple[list[int], dict[int, Call]]
    started: float
    released: dict[int, threading.Event] = field(default_factory=dict)
    joined: threading.Event = field(default_factory=threading.Event)
    consumed: threading.Event = field(default_factory=threading.Event)


class Breaker:
    """The watchdog's part in ending mismatches of one rank's direct groups; see the module
    docstring.  Groups register their :class:`KnownCalls` when made.  ``watched_thread`` is
    the thread whose blocked calls deadlock detection sees (None: every thread); calls made
    on any other are checked every time."""

    def __init__(self, watched_thread: int | None = threading.main_thread().ident) -> None:
        self.watched_thread = watched_thread
        self._groups: dict[str, KnownCalls] = {}
        self._current: _Break | None = None

    def register(self, known: KnownCalls) -> None:
        self._groups[known.ident] = known

    def unregister(self, known: KnownCalls) -> None:
        if self._groups.get(known.ident) is known:
            del self._groups[known.ident]

    def status(self) -> list | None:
        """What this rank's probe answers say while it ends a mismatch."""
        current = self._current
        return None if current is None else current.ident

    def take(self, me: int, ranks: Sequence[int], calls: Mapping[int, Call], now: float) -> bool:
        """Whether the deadlock of ``ranks`` (``calls``: what each is blocked in) is a mismatch
        this rank ends; if so, start to."""
        if self._current is not None:
            return True  # found again while it is being ended
        plan = self._plan(me, ranks, calls)
        if plan is None:
            return False
        known, n, paths = plan
        mine = paths[me][0]
        targets = {path: tuple(r for r in sorted(paths) if paths[r][0] == path)
                   for path in sorted({path for path, _ in paths.values()}) if path != mine}
        current = _Break(known, [known.ident, n], targets, (list(ranks), dict(calls)), now)
        current.released = {path: threading.Event() for path in targets}
        known.consumed = current.consumed.set
        known.broken = (known.mismatch([(r, path, words, calls[r].site) for r, (path, words) in paths.items()]),
                        current.joined)
        self._current = current
        threading.Thread(target=self._join, args=(current,), name="psrt-mismatch", daemon=True).start()
        return True

    def step(self, now: float, prober) -> tuple[list[int], dict[int, Call]] | None:
        """Move the current mismatch on: release each path whose blocked ranks all say they
        are breaking (asking them again until they do).  Returns the deadlock to report
        instead, if it could not be ended in time."""
        current = self._current
        if current is None:
            return None
        if current.consumed.is_set():
            self._current = None
            return None
        if now - current.started > BREAK_WITHIN_S:
            return current.found
        answers = prober.answers()
        asking = []
        for path, ranks in current.targets.items():
            if current.released[path].is_set():
                continue
            if all(answers.get(r, (0.0, {}))[1].get("breaking") == current.ident for r in ranks):
                current.released[path].set()
            else:
                asking.extend(ranks)
        if asking:
            prober.ask(asking)
        return None

    def _plan(self, me: int, ranks: Sequence[int], calls: Mapping[int, Call]
              ) -> tuple[KnownCalls, int, dict[int, tuple[int, str]]] | None:
        """(the group, the collective's number, each rank's (path, words)) when every rank of
        the deadlock is a member of one registered group, all of them blocked in its same
        collective on paths that can be joined, and not all on the same one."""
        mine = calls.get(me)
        if mine is None or len(mine.ident) < 4 or mine.ident[0] != DIRECT:
            return None
        group, n = mine.ident[1], mine.ident[2]
        known = self._groups.get(group)
        if known is None or set(ranks) != set(mine.peers):
            return None
        paths = {}
        for rank in ranks:
            ident = calls[rank].ident
            if len(ident) < 4 or tuple(ident[:3]) != (DIRECT, group, n) or ident[3] < CHECK:
                return None
            paths[rank] = (ident[3], str(ident[4]) if ident[3] == CHECK else "")
        return (known, n, paths) if len({path for path, _ in paths.values()}) > 1 else None

    @staticmethod
    def _join(current: _Break) -> None:
        """Join the other paths' collectives in order, each once released (a thread of its own:
        the watchdog keeps answering probes meanwhile)."""
        try:
            for path in sorted(current.targets):
                current.released[path].wait()
                current.known.join(path)
        except Exception:
            logger.exception("psrt: joining the collectives of a mismatch failed")
        finally:
            current.joined.set()
