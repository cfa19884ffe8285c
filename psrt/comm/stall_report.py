"""The text of a stall report: what the ranks a wait waits on answered when probed, the
ranks those wait for in turn, and the rank to blame.

A probed rank answers with its status (:meth:`psrt.comm.watchdog.Watchdog.status`): its
lasting waits (kind, description, the ranks each waits on), the call its main thread is
blocked in, or else where that thread is, and its last psrt call.  Ranks are named by
``name_rank`` (``rank 3``, or ``rank 3 (worker 1)`` in parameter-server mode).
"""
from __future__ import annotations

from typing import Callable

from launcher import contract
from psrt.comm.ranks import rank_ranges

NameRank = Callable[[int], str]
Heard = dict[int, dict]
#: Of a probed rank's waits (and of the ranks it answers with), the report shows this many.
MAX_SHOWN = 3


def busy(status: dict) -> bool:
    """Whether a probed rank said it waits in psrt itself."""
    return bool(status["waits"]) or bool(status.get("call"))


def names(ranks: list[int], name_rank: NameRank) -> str:
    return name_rank(ranks[0]) if len(ranks) == 1 else "ranks " + rank_ranges(ranks)


def peers_text(peers: list[int], heard: Heard, name_rank: NameRank) -> str:
    """What each rank waited on said (or that it said nothing), grouped."""
    if not peers:
        return ""
    silent = [r for r in peers if r not in heard]
    idle = [r for r in peers if r in heard and not busy(heard[r])]
    waiting: dict[str, list[int]] = {}
    for r in peers:
        if r in heard and busy(heard[r]):
            waiting.setdefault(_first_wait(heard[r])[0], []).append(r)
    parts = []
    if silent:
        parts.append(f"{names(silent, name_rank)} {'does' if len(silent) == 1 else 'do'} not respond (stopped, "
                     "hung, or cut off from this host)")
    for kind, ranks in waiting.items():
        if len(ranks) == 1:
            parts.append(f"{names(ranks, name_rank)} waits: {_first_wait(heard[ranks[0]])[1]}")
        else:
            parts.append(f"{names(ranks, name_rank)} wait in {kind}")
    if idle:
        one = len(idle) == 1
        parts.append(f"{names(idle, name_rank)} {'answers' if one else 'answer'} but {'waits' if one else 'wait'} "
                     "for nothing in psrt (busy in its own code, or not calling this)")
        parts += [whereabouts(r, heard[r], name_rank) for r in idle[:MAX_SHOWN]]
    return ": " + "; ".join(p for p in parts if p)


def _first_wait(status: dict) -> tuple[str, str]:
    """A busy rank's first lasting wait (kind, description), or the call it is blocked in."""
    if status["waits"]:
        return status["waits"][0][0], status["waits"][0][1]
    return "a psrt call", status["call"]["what"]


def beyond(me: int, peers: list[int], heard: Heard) -> list[int]:
    """The ranks that the peers which answer, waiting themselves, wait for."""
    further = {r for peer in peers if peer in heard for entry in heard[peer]["waits"]
               for r in (entry[2] if len(entry) > 2 else ())}
    return sorted(further - set(peers) - {me})


def beyond_text(further: list[int], peers: list[int], heard: Heard, name_rank: NameRank) -> str:
    """What the ranks one further said, where they do not wait themselves."""
    if not further:
        return ""
    waiters = [r for r in peers if r in heard and heard[r]["waits"]]
    through = f"which {names(waiters, name_rank)} {'waits' if len(waiters) == 1 else 'wait'} for"
    silent = [r for r in further if r not in heard]
    idle = [r for r in further if r in heard]
    parts = []
    if silent:
        one = len(silent) == 1
        parts.append(f"{names(silent, name_rank)}, {through}, {'does' if one else 'do'} not respond (stopped, "
                     "hung, or cut off from this host)")
    if idle:
        one = len(idle) == 1
        parts.append(f"{names(idle, name_rank)}, {through}, {'answers' if one else 'answer'} but "
                     f"{'waits' if one else 'wait'} for nothing in psrt")
        parts += [whereabouts(r, heard[r], name_rank) for r in idle[:MAX_SHOWN]]
    return "; " + "; ".join(p for p in parts if p)


def whereabouts(rank: int, status: dict, name_rank: NameRank) -> str:
    """Where an answering rank that waits for nothing in psrt is, and its last psrt call."""
    where = [f"it runs {status['at']}" if status.get("at") else "",
             f"its last psrt call was {status['last']}" if status.get("last") else ""]
    where = [w for w in where if w]
    return f"{name_rank(rank)}: {', '.join(where)}" if where else ""


def blame_line(me: int, peers: list[int], heard: Heard, what: str, waited: float, name_rank: NameRank) -> str | None:
    """The line that names the rank to blame, which psrun headlines (not ``me``, which only
    noticed): the first of ``peers`` that stopped answering, else the first that answers but
    is in no psrt call (busy in its own code); None if there is none."""
    silent = [r for r in peers if r not in heard]
    idle = [r for r in peers if r in heard and not busy(heard[r])]
    culprits = silent or idle
    if not culprits:
        return None
    why = "stopped answering" if silent else "answers but never came (busy in its own code)"
    others = f" (and {names(culprits[1:], name_rank)})" if culprits[1:] else ""
    return contract.blame_line(me, name_rank(culprits[0]), f"{why}{others} while {what} waited {waited:.0f} s")
