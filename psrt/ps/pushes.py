"""A parameter server's receives for pushes, posted before the pushes are made.

Each worker's pushes to a chunk travel on the chunk's push tag into a receive the server
posted as soon as the worker's init of the chunk succeeded, and posts again as each push
arrives.  So a push's bytes move as soon as the worker sends them: the transfer never
waits for the server's loop to read the push's header and post a receive (a turn of the
loop per push, and for a large push a rendezvous that cannot start before it).  A push's
header still comes, on the worker's header tag, and says which receive to watch: the loop
tests only those, however many chunks a model has.

Each receive is a persistent one, set up once per buffer it fills: a slot's buffers come
from its chunk's small pool (the value's and the gradients' buffers swap in and out of it),
so a few set-ups serve every push, and posting the next receive is a start (about a
microsecond over MPI, against about 15 for a fresh receive in the server's loop).

A worker that shuts down sends one empty message on each of its push tags (after every
push it made), which completes the receives posted for it, so the server ends with no
receive left open.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import torch

from psrt.comm.base import Communicator, Persistent, Request
from psrt.ps.shard import Shard

#: Persistent receives a slot keeps, one per buffer it has received into: the pool of a
#: chunk holds about two buffers per worker, so more than this means buffers come and go,
#: and the oldest set-up is released.
_RECEIVES_PER_SLOT = 8


class _Slot:
    """The receive posted for one worker's next push to one chunk."""

    __slots__ = ("announced", "buffer", "closing", "receives", "request", "shard", "since", "tag", "worker")

    def __init__(self, worker: int, shard: Shard, tag: int) -> None:
        self.worker, self.shard, self.tag = worker, shard, tag
        self.buffer = shard.spare_buffer()
        self.request: Request | None = None
        # by buffer address: the buffer (held, so the address stays its own) and its receive
        self.receives: dict[int, tuple[torch.Tensor, Persistent]] = {}
        # per push announced and not yet in: the buffer to post next (None: the push is refused,
        # its data is received and dropped)
        self.announced: deque[torch.Tensor | None] = deque()
        self.closing = False  # the worker has shut down: its empty message ends the slot
        self.since = 0.0


class PostedPushes:
    """Every worker's posted push receives on one server, over ``comm`` (``ranks[w]`` is
    worker w's rank there)."""

    def __init__(self, comm: Communicator, ranks: Sequence[int]) -> None:
        self._comm, self._ranks = comm, ranks
        self._slots: dict[tuple[int, Shard], _Slot] = {}
        self._watched: list[_Slot] = []  # slots with announced pushes, or closing

    def open(self, worker: int, shard: Shard, tag: int) -> None:
        """Post the receive of ``worker``'s first push to ``shard`` (once per pair)."""
        if (worker, shard) not in self._slots:
            slot = self._slots[(worker, shard)] = _Slot(worker, shard, tag)
            self._post(slot)

    def announce(self, worker: int, shard: Shard, accepted: bool) -> None:
        """A push header arrived: watch the receive; an ``accepted`` push is counted by the
        shard (which hands out the buffer for the push after it), another one is dropped."""
        slot = self._slots[(worker, shard)]
        slot.announced.append(shard.expect_push(worker) if accepted else None)
        self._watch(slot)

    def has(self, worker: int, shard: Shard) -> bool:
        return (worker, shard) in self._slots

    def close(self, worker: int) -> None:
        """``worker`` has shut down: watch each of its slots until its empty message is in."""
        for slot in [s for (w, _), s in self._slots.items() if w == worker]:
            slot.closing = True
            self._watch(slot)

    def poll(self) -> list[Shard]:
        """Hand every push that has arrived to its shard; returns the shards given one."""
        touched = []
        for slot in [s for s in self._watched if s.request.test()]:
            if slot.announced:
                following = slot.announced.popleft()
                if following is not None:
                    slot.shard.arrived(slot.worker, slot.buffer)
                    slot.buffer = following
                    touched.append(slot.shard)
                self._post(slot)
                if slot.announced or slot.closing:
                    slot.since = time.monotonic()
                    continue
            elif slot.closing:
                del self._slots[(slot.worker, slot.shard)]
                for _, receive in slot.receives.values():
                    receive.free()
            self._watched.remove(slot)
        return touched

    @property
    def open_slots(self) -> bool:
        return bool(self._slots)

    @property
    def watching(self) -> bool:
        return bool(self._watched)

    def waiting(self) -> list[tuple[int, float]]:
        """(worker, since when) of each push whose data the server still waits for."""
        return [(slot.worker, slot.since) for slot in self._watched]

    def _watch(self, slot: _Slot) -> None:
        if slot not in self._watched:
            slot.since = time.monotonic()
            self._watched.append(slot)

    def _post(self, slot: _Slot) -> None:
        """Start the receive into the slot's buffer (set up on the buffer's first use; only
        one receive of a slot is under way at a time, so any other may be released)."""
        address = slot.buffer.data_ptr()
        entry = slot.receives.get(address)
        if entry is None:
            if len(slot.receives) >= _RECEIVES_PER_SLOT:
                _, oldest = slot.receives.pop(next(iter(slot.receives)))
                oldest.free()
            entry = slot.receives[address] = (
                slot.buffer, self._comm.persistent_recv(slot.buffer, self._ranks[slot.worker], slot.tag))
        slot.request = entry[1].start()
