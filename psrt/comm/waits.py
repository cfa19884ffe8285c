"""What a rank marks while it waits on other ranks: a :class:`Wait`, and the stack of a
thread's waits.

Every place in psrt that waits on other ranks marks the wait (the engine's rounds, the
direct layer's collectives and messages, a worker's requests to parameter servers,
start-up); the stall watchdog (:mod:`psrt.comm.watchdog`) reads the marks from its own
thread.  Marking must cost next to nothing, so a wait holds its description and its ranks
as given (strings, or functions called only once the wait has become a stall).  Kept apart
from the watchdog, which decides what a stall is and whom to blame, because the marks are
what every layer writes and the watchdog is one reader of them.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

Text = str | Callable[[], str]
Ranks = Sequence[int] | Callable[[], Sequence[int]]


class Wait:
    """Something this rank waits for on other ranks: a short ``kind`` to group ranks by
    ("an engine negotiation round"), a description, the ranks it waits on, and since when.

    As the context :meth:`psrt.comm.watchdog.Watchdog.waiting` returns, it marks the calling thread for the
    block's duration; it is cheap enough for every engine round and TP collective: the
    description and the ranks are looked at only once the wait has become a stall.

    A wait with an ``ident`` is a *call* the thread is blocked in (a collective, a
    receive, the shutdown), which deadlock detection compares across ranks (see
    :mod:`psrt.comm.deadlock`): ``ident`` is the same on every rank for the same
    collective, and ``needs`` (a function, in the same ranks as ``peers``) says which
    ranks the call still needs, or None while it cannot tell; without ``needs``, a
    collective needs the members not in it.
    """

    __slots__ = ("kind", "what", "peers", "since", "key", "ends_job", "stalls", "ident", "needs", "_to_job",
                 "_stack")

    def __init__(self, kind: str, what: Text, peers: Ranks, since: float = 0.0, key: object = None,
                 to_job: Callable[[Iterable[int]], tuple[int, ...]] | None = None,
                 stack: WaitStack | None = None, ends_job: bool = True, ident: tuple | None = None,
                 needs: Callable[[], Sequence[int] | None] | None = None) -> None:
        self.kind, self.what, self.peers, self.since, self.key = kind, what, peers, since, key
        self.ends_job = ends_job  # False: a wait by design, reported but never ending the job
        self.stalls = True  # False: a call whose stall another wait reports (see Watchdog.waiting)
        self.ident, self.needs = ident, needs
        self._to_job, self._stack = to_job, stack  # peers in psrt's world, mapped to job ranks

    def __enter__(self) -> None:
        self.since = time.monotonic()
        self._stack.append(self)

    def __exit__(self, *exc: object) -> None:
        stack = self._stack
        stack.pop()
        if self.ident is not None:
            stack.last = (self.kind, self.what)

    def describe(self) -> str:
        return describe(self.what, self.kind)

    def peer_ranks(self) -> tuple[int, ...]:
        """The job ranks waited on."""
        try:
            peers = self.peers() if callable(self.peers) else self.peers
            return tuple(peers) if self._to_job is None else self._to_job(peers)
        except Exception:
            return ()

    def needed_ranks(self) -> tuple[int, ...] | None:
        """The job ranks the call still needs (see the class docstring), or None."""
        try:
            needs = self.needs()
            if needs is None:
                return None
            return tuple(needs) if self._to_job is None else self._to_job(needs)
        except Exception:  # read while its owner changes state: ask again next time
            return None


def describe(what: Text, kind: str) -> str:
    """``what``, evaluated if it is a function; a wait described while its owner changes
    state says so rather than fail."""
    try:
        return what() if callable(what) else what
    except Exception as e:  # a description read while its owner changes state
        return f"{kind} (not described: {type(e).__name__})"


class WaitStack(list):
    """A thread's waits, innermost last, and the last call it left: (kind, what)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        super().__init__()
        self.last: tuple[str, Text] | None = None
