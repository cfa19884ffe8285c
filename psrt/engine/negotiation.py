"""Negotiation: every rank learns which named works are ready on all ranks of their set.

Each engine cycle is one round, run by every rank of the world in lockstep on
the engine's own communicator:

* **Fast path** (the steady state of a training loop).  Works seen before sit
  in the :class:`ResponseCache`, identical on every rank.  One small
  MIN-allreduce of two bytes per cached entry (``ready`` and ``absent``) tells
  every rank which cached works are ready everywhere, plus one control byte
  saying whether anybody needs the slow path.
* **Slow path** (new names, new shapes, joins, shutdown, or a work that has
  waited long).  Ranks allgather announcements of their works not yet
  announced.  Every rank then runs the same deterministic coordinator logic on
  the same messages — a replicated coordinator, which saves Horovod's separate
  gather and broadcast — so all ranks keep an identical table of partially
  submitted works, and decide the same responses, cache entries and errors in
  the same order.

A work is resolved either by the fast path (every member still has it
unannounced) or by the table (it was announced), never both.  Ranks that have
joined count as ready for allreduces and contribute zeros.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from psrt.comm.base import Communicator, Persistent, ElementwiseOp, Request
from psrt.engine.work import Announcement, Work, WorkKey
from psrt.engine.mismatch import describe_mismatch


class ResponseCache:
    """Announcements that completed before, in the same order on every rank.

    Entries are only added from negotiation results, which every rank computes
    identically, so an entry's index is the same everywhere and a bit per entry
    is enough to negotiate it.  Full means no new entries (new works then take
    the slow path every time), never eviction, which would need another round.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: list[Announcement] = []
        self._index: dict[WorkKey, int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, announcement: Announcement) -> int | None:
        """The entry's index if the same work (key and descriptor) is cached."""
        index = self._index.get(announcement.key)
        if index is not None:
            entry = self.entries[index]
            if entry is announcement:  # callers reuse theirs
                return index
            if entry == announcement:  # the entry came in a round: keep the caller's, equal and
                self.entries[index] = announcement  # found by identity next time
                return index
        return None

    def add(self, announcement: Announcement) -> None:
        if len(self.entries) < self.capacity and announcement.key not in self._index:
            self._index[announcement.key] = len(self.entries)
            self.entries.append(announcement)


@dataclass
class Response:
    """A decision every rank reached: run this work now, or fail it with ``error``."""

    announcement: Announcement
    error: str | None = None


@dataclass
class _Pending:
    """A work announced by some ranks, waiting in the shared table for the others."""

    first_seen: float
    by_rank: dict[int, Announcement] = field(default_factory=dict)


@dataclass
class RoundResult:
    responses: list[Response]
    # Some rank still has a work waiting for others (or has joined): every engine
    # should keep negotiating at the normal pace.  The same on every rank.
    waiting: bool = False
    join_completed: int | None = None  # the last rank to join, once every rank has
    shutdown_by: list[int] = field(default_factory=list)


class Negotiator:
    """The negotiation state of one rank; identical on every rank after each round."""

    def __init__(self, comm: Communicator, cache_capacity: int) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.cache = ResponseCache(cache_capacity)
        self.table: dict[WorkKey, _Pending] = {}
        self.joined: list[int] = []
        self.rounds = 0  # rounds held so far: the same number on every rank
        self._join_started = 0.0  # when the first rank of the current join joined
        self._fast: tuple[memoryview, bytes, Persistent] | None = None
        self._fast_key: tuple[int, list[int]] = (-1, [])

    # -- the fast path -------------------------------------------------------------
    def _fast_state(self) -> tuple[memoryview, bytes, Persistent]:
        """The round's vector (as bytes to write and read), its template and the persistent
        allreduce over it, rebuilt (collectively: the cache and the joined ranks change
        alike on every rank) when the cache grows or ranks join.  The template holds, per
        cached entry, whether this rank counts as ready without having the work: it is not
        a member of the entry's set, or it has joined and the entry is an allreduce."""
        if len(self.cache.entries) != self._fast_key[0] or self.joined != self._fast_key[1]:
            joined = self.rank in self.joined
            n = len(self.cache)
            template = bytearray(b"\x01" * (1 + 2 * n))
            template[1:1 + n] = bytes(self.rank not in e.ranks or (joined and e.reduction is not None)
                                      for e in self.cache.entries)
            vector = torch.frombuffer(bytearray(template), dtype=torch.uint8)
            if self._fast is not None:
                self._fast[2].free()
            self._fast = (memoryview(vector.numpy()), bytes(template),
                          self.comm.persistent_allreduce(vector, ElementwiseOp.MIN))
            self._fast_key = (n, list(self.joined))
        return self._fast

    def _fast_round(self, local: dict[WorkKey, Work], need_slow: bool,
                    wait: Callable[[Request], None]) -> tuple[list[Response], bool, bool]:
        """(responses, whether the slow path follows, whether a cached work is still waiting).

        The vector is one MIN-allreduce: a control byte (0: somebody needs the slow path),
        then per cached entry ``ready`` (1 unless a member lacks the work) and ``absent``
        (0 if some rank holds the work).  Plain byte operations: a round carries a few
        works, where numpy's per-call cost would dominate."""
        vector, template, allreduce = self._fast_state()
        vector[:] = template
        n = len(self.cache)
        for work in local.values():
            if work.cache_index is not None and not work.reported:
                vector[1 + work.cache_index] = 1
                vector[1 + n + work.cache_index] = 0
        vector[0] = 0 if need_slow else 1
        wait(allreduce.start())
        return self._fast_result(vector, n)

    def _fast_result(self, vector: memoryview, n: int) -> tuple[list[Response], bool, bool]:
        """What a completed fast round's vector says (see :meth:`_fast_round`)."""
        absent = bytes(vector[1 + n:])
        held = []
        index = absent.find(0)
        while index >= 0:
            held.append(index)
            index = absent.find(0, index + 1)
        hits = [i for i in held if vector[1 + i]]
        entries = self.cache.entries
        return [Response(entries[i]) for i in hits], vector[0] == 0, len(hits) < len(held)

    # -- the slow path -------------------------------------------------------------
    def _slow_round(self, announcements: list[Announcement], join: bool,
                    shutdown: bool) -> RoundResult:
        messages = self.comm.allgather_object((announcements, join, shutdown))
        now = time.monotonic()
        result = RoundResult([])
        for rank, (theirs, joining, stopping) in enumerate(messages):
            for announcement in theirs:
                pending = self.table.setdefault(announcement.key, _Pending(now))
                pending.by_rank[rank] = announcement
            if joining:
                if not self.joined:
                    self._join_started = now
                self.joined.append(rank)
            if stopping:
                result.shutdown_by.append(rank)
        for key, pending in list(self.table.items()):
            response = self._decide(pending)
            if response is not None:
                del self.table[key]
                result.responses.append(response)
                if response.error is None and response.announcement.cacheable:
                    self.cache.add(response.announcement)
        if len(set(self.joined)) == self.comm.size:
            result.join_completed = self.joined[-1]
            self.joined = []
        return result

    def _decide(self, pending: _Pending) -> Response | None:
        """A response once every member has submitted (or joined, for allreduces), else None."""
        announcements = pending.by_rank
        first = next(iter(announcements.values()))
        joined_members = [r for r in first.ranks if r in self.joined and r not in announcements]
        missing = [r for r in first.ranks if r not in announcements and r not in joined_members]
        if missing:
            return None
        if len(set(announcements.values())) > 1:
            descriptors = {rank: a.descriptor for rank, a in sorted(announcements.items())}
            return Response(first, describe_mismatch(first.name, descriptors))
        if joined_members and first.reduction is None:
            return Response(first, f"{first.describe()} cannot run: ranks "
                                   f"{joined_members} have joined, and after join() only "
                                   "allreduce is supported")
        return Response(first)

    def close(self) -> None:
        """Free the round's allreduce and the communicator (after the last round)."""
        if self._fast is not None:
            self._fast[2].free()
            self._fast = None
        self.comm.free()

    def forget_involving(self, gone: set[int]) -> None:
        """Drop announced works whose process set includes a rank that has shut down, and
        the current join: they can never complete (identical on every rank, as the table is)."""
        self.joined = []
        for key, pending in list(self.table.items()):
            first = next(iter(pending.by_rank.values()))
            if gone.intersection(first.ranks):
                del self.table[key]

    # -- one round -----------------------------------------------------------------------
    def round(self, local: dict[WorkKey, Work], fresh: Sequence[Work], join: bool,
              shutdown: bool, wait: Callable[[Request], None]) -> RoundResult:
        """Negotiate: ``local`` are this rank's unfinished works, ``fresh`` those that
        need announcing now (new to the cache, or waited too long)."""
        self.rounds += 1
        need_slow = bool(fresh or join or shutdown or self.table)
        responses, slow, waiting = self._fast_round(local, need_slow, wait)
        return self.complete_round(local, responses, slow, waiting, join, shutdown)

    def round_alone(self, index: int, wait: Callable[[Request], None]) -> tuple[list[Response], bool, bool] | None:
        """The round of a rank whose one unfinished work is cache entry ``index``, with
        nothing in the table and nobody joined: None when it shows that work ready on every
        rank and nothing else held or asked for anywhere (so every rank goes quiet after
        it), else what :meth:`complete_round` needs.  The same collective as :meth:`round`,
        with only the bytes this case needs written and read."""
        self.rounds += 1
        vector, template, allreduce = self._fast_state()
        vector[:] = template  # control byte 1: this rank needs no slow path
        n = len(self.cache.entries)
        vector[1 + index] = 1
        vector[1 + n + index] = 0
        wait(allreduce.start())
        if vector[0] and vector[1 + index] and bytes(vector[1 + n:]).count(0) == 1:
            return None
        return self._fast_result(vector, n)

    def complete_round(self, local: dict[WorkKey, Work], responses: list[Response], slow: bool,
                       waiting: bool, join: bool, shutdown: bool) -> RoundResult:
        """The rest of a round once its fast path is known: the slow path, if any rank
        asked for it."""
        if not slow:
            return RoundResult(responses, waiting or bool(self.joined))
        resolved = {r.announcement.key for r in responses}
        unannounced = [w for w in local.values() if not w.reported and w.key not in resolved]
        for work in unannounced:
            work.reported = True
        result = self._slow_round([w.announcement for w in unannounced], join, shutdown)
        result.responses[:0] = responses
        result.waiting = waiting or bool(self.table) or bool(self.joined)
        return result

    def missing(self, key: WorkKey) -> list[int] | None:
        """The ranks that have not submitted work ``key``, or None while the table does not
        know it (a work waits in it once announced: when new, or after waiting a while).
        Read from the watchdog's thread: a work just resolved gives None."""
        pending = self.table.get(key)
        return None if pending is None else self._missing_from(pending)

    def _missing_from(self, pending: _Pending) -> list[int]:
        """The members of a table work that have neither submitted it nor joined."""
        by_rank = dict(pending.by_rank)  # one step under the GIL: the engine thread adds to it
        return [r for r in next(iter(by_rank.values())).ranks if r not in by_rank and r not in self.joined]

    def stalled(self, older_than: float) -> list[tuple[str, float, list[int], list[int]]]:
        """What has waited at least ``older_than`` seconds for some ranks: (what, seconds
        waited, ranks that are there, ranks missing), for table works and for a join."""
        now = time.monotonic()
        stalled = []
        for pending in self.table.values():
            if now - pending.first_seen >= older_than:
                first = next(iter(pending.by_rank.values()))
                stalled.append((first.describe(), now - pending.first_seen, sorted(pending.by_rank),
                                self._missing_from(pending)))
        if self.joined and now - self._join_started >= older_than:
            have = sorted(set(self.joined))
            stalled.append(("join", now - self._join_started, have,
                            [r for r in range(self.comm.size) if r not in have]))
        return stalled
