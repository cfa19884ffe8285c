"""Requests in flight between a worker and the servers: a server's reply to one request,
and the handle a KVStore call returns for them.

A reply is a header (its status, and the length of what follows), then a payload or an
error text; a handle waits for every message of its request and re-raises, on every
``wait()``, what any server reported.  Handles may be waited for from several threads.
Waiting is marked on the worker's direct group, naming the servers waited on, so a
server that freezes or drops off the network ends the job with a report instead of
hanging its workers.  A wait for replies is a *held* call (:data:`psrt.comm.deadlock.HELD`)
naming each request by its server and tag, so that deadlock detection can ask the servers
which workers they hold it for.  A wait spins briefly, then naps, leaving the CPU to a
server that shares the host (a longer spin measured worse with 2 workers and a server on
2 cores: a 1 MiB pull at 0.17 of mpi4py's speed against 0.35).
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from psrt.comm.base import Request
from psrt.comm.deadlock import HELD
from psrt.comm.header import HEADER_WORDS, Header
from psrt.comm.poll import wait_politely
from psrt.errors import ParameterServerError, PsrtError
from psrt.ps import protocol
from psrt.ps.protocol import Status
from psrt.ps.service import WorkerLink


class Reply:
    """A server's answer to one request: a header, then a payload or an error text.  Posts
    its receives (of the header, and of a pull's data into ``receive_into``) at once."""

    def __init__(self, link: WorkerLink, server: int, tag: int, receive_into: torch.Tensor | None = None) -> None:
        self._link, self.tag = link, tag  # the tag names the request to its server
        rank = self.server_rank = link.server_rank(server)
        self._status = torch.empty(HEADER_WORDS, dtype=torch.int64)
        self._status_request = link.comm.irecv(self._status, rank, tag)
        self._data_request = None if receive_into is None else link.comm.irecv(receive_into, rank, tag + 1)
        self._outcome: tuple[str | None, object] | None = None

    def test(self) -> bool:
        return self._status_request.test() and (self._data_request is None or self._data_request.test())

    def wait(self) -> tuple[str | None, object]:
        """(error text or None, decoded JSON payload or None)."""
        if self._outcome is None:
            self._outcome = self._receive()
        return self._outcome

    def _receive(self) -> tuple[str | None, object]:
        wait_politely(self._status_request)
        status = Header.decode(self._status.tolist())
        code, length = status.kind, status.numel
        if self._data_request is not None:
            wait_politely(self._data_request)
        if code == Status.OK and (self._data_request is not None or length == 0):
            return None, None
        body = torch.empty(length, dtype=torch.uint8)
        text_tag = self.tag + (2 if self._data_request is not None else 1)
        wait_politely(self._link.comm.irecv(body, self.server_rank, text_tag))
        if code != Status.OK:
            return protocol.decode_text(body), None
        return None, protocol.decode(body)


class Handle:
    """An asynchronous KVStore request; :meth:`wait` returns the pulled tensor (None for
    a push) and raises what any server reported."""

    def __init__(self, sends: list[Request], replies: list[Reply], result: torch.Tensor | None = None,
                 finish: Callable[[], None] | None = None, *, link: WorkerLink | None = None,
                 servers: tuple[int, ...] = (), what: str = "request") -> None:
        self._sends, self._replies, self._result, self._finish = sends, replies, result, finish
        self._link, self.servers, self.what = link, servers, what
        self._parts: list[Handle] = []  # handles this one was joined from
        self._lock = threading.Lock()
        self._error: PsrtError | None = None
        self.finished = False
        self.payloads: list[object] = []

    def done(self) -> bool:
        """Whether :meth:`wait` would return without blocking."""
        return all([r.test() for r in self._sends]) and all([r.test() for r in self._replies])

    def wait(self) -> torch.Tensor | None:
        """Block until every message of the request is through; raises (every time it is
        called) what went wrong."""
        with self._lock:
            if not self.finished:
                try:
                    if self._link is None:
                        self._settle()
                    else:
                        with self._link.group.waiting("a parameter-server request", self._describe,
                                                      self.servers, ident=self._held()):
                            self._settle()
                except PsrtError as e:
                    self._error = e
                finally:
                    self.finished = True
                    for part in self._parts:
                        part.finished = True
            if self._error is not None:
                raise self._error
            return self._result

    def _held(self) -> tuple | None:
        """The identity of a wait for replies: (HELD, server rank, tag, ...), by which the
        servers know the requests (None for sends alone, which need no other worker)."""
        if not self._replies:
            return None
        return (HELD, *(number for reply in self._replies for number in (reply.server_rank, reply.tag)))

    def _describe(self) -> str:
        assert self._link is not None
        servers = [str(self._link.roles.server_index(rank)) for rank in self.servers]
        return (f"worker {self._link.worker}'s {self.what} to parameter server{'s' if len(servers) > 1 else ''} "
                f"{', '.join(servers)}")

    def _settle(self) -> None:
        for request in self._sends:
            wait_politely(request)
        errors = []
        for reply in self._replies:  # every reply, even after an error: none is left unreceived
            error, payload = reply.wait()
            errors.append(error) if error is not None else self.payloads.append(payload)
        if errors:
            raise ParameterServerError("; ".join(dict.fromkeys(errors)))
        if self._finish is not None:
            self._finish()

    @staticmethod
    def joined(handles: list[Handle], result: torch.Tensor | None = None,
               finish: Callable[[], None] | None = None, what: str | None = None) -> Handle:
        """One handle for all of ``handles``; ``finish`` runs after theirs, once all succeeded."""
        finishes = [h._finish for h in handles if h._finish is not None] + ([finish] if finish else [])
        joined = Handle([r for h in handles for r in h._sends], [r for h in handles for r in h._replies],
                        result, (lambda: [f() for f in finishes]) if finishes else None,
                        link=next((h._link for h in handles), None),
                        servers=tuple(sorted({s for h in handles for s in h.servers})),
                        what=what or " and ".join(dict.fromkeys(h.what for h in handles)) or "request")
        joined._parts = [part for h in handles for part in (h, *h._parts)]
        return joined
