"""A parameter server's messages with its workers: the sends and receives under way, the
replies to requests, and the errors a worker hears with its next reply.

Nothing here blocks: a message is started and kept with what to run once it completes, and
the server's loop (:class:`psrt.ps.server.Server`) polls them between turns.  A request that
has a reply gets its error at once; a push or a learning rate has none, so its error waits
for the worker's next reply about the same store (:meth:`Replies.defer`), or is printed here
if the worker has left.  The layout of a reply is :mod:`psrt.ps.protocol`'s.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from psrt.comm.base import Communicator, Request
from psrt.ps import protocol
from psrt.ps.protocol import Status
from psrt.ps.shard import Shard

_OK = protocol.reply(Status.OK).encode()  # a send buffer every reply of a pull may share


class Replies:
    """The messages of one server (``name``, as errors name it) with the workers whose job
    ranks are ``workers``, over ``comm``."""

    def __init__(self, comm: Communicator, workers: Sequence[int], name: str) -> None:
        self._comm, self._workers, self._name = comm, workers, name
        # messages under way: (request, what to run once done, since, the worker, "receive"/"send")
        self.inflight: list[tuple[Request, Callable[[], None] | None, float, int, str]] = []
        # (worker, store): errors of requests without a reply (pushes, learning rates), given
        # with the worker's next reply about that store
        self._deferred: dict[tuple[int, int], list[str]] = {}

    # -- messages -------------------------------------------------------------------------
    def receive(self, worker: int, tensor: torch.Tensor, tag: int, then: Callable[[], None] | None = None) -> None:
        self.inflight.append((self._comm.irecv(tensor, self._workers[worker], tag), then, time.monotonic(), worker,
                              "receive"))

    def send(self, worker: int, tensor: torch.Tensor, tag: int, then: Callable[[], None] | None = None) -> None:
        request = self._comm.isend(tensor, self._workers[worker], tag)
        if then is None and request.test():  # a small reply usually leaves at once
            return
        self.inflight.append((request, then, time.monotonic(), worker, "send"))

    def poll(self) -> bool:
        """Run what follows each message that has completed; whether any had."""
        done = [(r, then) for r, then, *_ in self.inflight if r.test()]
        if not done:
            return False
        finished = {id(r) for r, _ in done}
        self.inflight = [entry for entry in self.inflight if id(entry[0]) not in finished]
        for _, then in done:
            if then is not None:
                then()
        return True

    def under_way(self) -> list[tuple[int, float, str]]:
        """(worker, since, "receive"/"send") of every message still under way."""
        return [(worker, since, direction) for _, _, since, worker, direction in self.inflight]

    # -- replies --------------------------------------------------------------------------
    def ack(self, worker: int, tag: int, payload: object = None, store_id: int | None = None) -> None:
        """Answer a request; with ``store_id``, an earlier push's error about that store
        is given instead."""
        error = self._take_deferred(worker, store_id)
        if error is not None:
            return self.ack_error(worker, tag, error)
        body = protocol.encode(payload) if payload is not None else None
        self.send(worker, protocol.reply(Status.OK, tag, 0 if body is None else body.numel()).encode(), tag)
        if body is not None:
            self.send(worker, body, tag + 1)

    def ack_error(self, worker: int, tag: int, text: str) -> None:
        body = protocol.text_bytes(f"{self._name}: {text}")
        self.send(worker, protocol.reply(Status.ERROR, tag, body.numel()).encode(), tag)
        self.send(worker, body, tag + 1)

    def answer_pull(self, worker: int, tag: int, shard: Shard, store_id: int, sent: Callable[[], None]) -> None:
        """Send ``shard``'s value (or an earlier push's error about its store); ``sent`` runs
        once the value has left, while ``shard.sending`` counts the sends under way."""
        error = self._take_deferred(worker, store_id)
        if error is not None:
            return self.refuse_pull(worker, tag, error)
        self.send(worker, _OK, tag)
        shard.sending += 1

        def done() -> None:
            shard.sending -= 1
            sent()
        self.send(worker, shard.value, tag + 1, done)

    def refuse_pull(self, worker: int, tag: int, text: str) -> None:
        body = protocol.text_bytes(f"{self._name}: {text}")
        self.send(worker, protocol.reply(Status.ERROR, tag, body.numel()).encode(), tag)
        self.send(worker, torch.empty(0, dtype=torch.uint8), tag + 1)  # completes the posted data receive
        self.send(worker, body, tag + 2)

    def defer(self, worker: int, store_id: int, text: str) -> None:
        """Give ``text`` with ``worker``'s next reply about store ``store_id``."""
        self._deferred.setdefault((worker, store_id), []).append(text)

    def take_unheard(self, worker: int) -> list[str]:
        """The errors ``worker`` will never hear (it has shut down), forgotten here."""
        unheard = []
        for (who, store_id), errors in list(self._deferred.items()):
            if who == worker:
                del self._deferred[(who, store_id)]
                unheard += errors
        return unheard

    def _take_deferred(self, worker: int, store_id: int | None) -> str | None:
        errors = None if store_id is None else self._deferred.pop((worker, store_id), None)
        return "; ".join(errors) if errors else None
