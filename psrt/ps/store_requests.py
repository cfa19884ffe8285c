"""A KVStore's requests to the parameter servers: posting each request's messages, and
keeping the handles until they are settled.

A request is a header on the server's header tag, then, on its own tag, a JSON document
and an init's data (:mod:`psrt.ps.protocol`); a request with a reply has the receive of the
answer posted before anything is sent, so the answer can never arrive unexpected.  Every
handle is kept until it is waited for or, without a reply, has left: ``psrt.shutdown()``
then finishes those nobody waited for (:meth:`StoreRequests.finish`), so a failure a server
reported is still printed.  Kept apart from :class:`psrt.ps.client.KVStore`, which decides
what to ask (keys, chunks, consistency): this module says how a request travels.
"""
from __future__ import annotations

import sys

import torch

from psrt.comm.base import Request
from psrt.errors import PsrtError
from psrt.ps import protocol
from psrt.ps.handles import Handle, Reply
from psrt.ps.placement import Chunk
from psrt.ps.protocol import HEADER_TAG, RequestKind
from psrt.ps.service import WorkerLink

_KEPT_SETTLED = 256  # handles kept before the settled ones are forgotten


class StoreRequests:
    """The requests of store ``store_id`` over this worker's ``link`` to the servers."""

    def __init__(self, link: WorkerLink, store_id: int) -> None:
        self._link, self._store_id = link, store_id
        self._open: list[Handle] = []

    def request(self, server: int, kind: RequestKind, chunk: Chunk | None = None, *, dtype: torch.dtype | None = None,
                meta: torch.Tensor | None = None, data: torch.Tensor | None = None, reply: bool = True,
                what: str | None = None) -> Handle:
        """Send one request (about ``chunk``'s elements of ``dtype``): a header, then ``meta``
        (a JSON document) and ``data`` (an init's value); with ``reply``, post the receive of
        the server's answer first."""
        sends: list[Request] = []
        replies: list[Reply] = []
        self.post(sends, replies, server, kind, chunk, dtype=dtype, meta=meta, data=data, reply=reply)
        return self.track(Handle(sends, replies, link=self._link, servers=(self._link.server_rank(server),),
                                 what=what or f"{kind.name.lower()} request"))

    def post(self, sends: list[Request], replies: list[Reply], server: int, kind: RequestKind, chunk: Chunk | None, *,
             dtype: torch.dtype | None, meta: torch.Tensor | None = None, data: torch.Tensor | None = None,
             reply: bool = True, receive_into: torch.Tensor | None = None) -> None:
        """Post one request's messages, adding them to ``sends`` and ``replies``; with
        ``receive_into``, the receive of the tensor data the server answers with (a pull)."""
        self.ensure_open()
        link, rank = self._link, self._link.server_rank(server)
        with link.lock:
            tag = link.next_tag()
            if reply:
                replies.append(Reply(link, server, tag, receive_into))
            header = protocol.request(kind, self._store_id, 0 if chunk is None else chunk.chunk_id, tag, dtype=dtype,
                                      numel=0 if chunk is None else chunk.numel, meta=meta,
                                      flag=int(data is not None))
            sends.append(link.comm.isend(header.encode(), rank, HEADER_TAG))
            if meta is not None:
                sends.append(link.comm.isend(meta, rank, tag))
            if data is not None:
                sends.append(link.comm.isend(data, rank, tag + 1))

    def everywhere(self, kind: RequestKind, document: object = None, reply: bool = True) -> Handle:
        """The same request, with ``document``, to every server: one handle for all."""
        handles = [self.request(server, kind, meta=None if document is None else protocol.encode(document),
                                reply=reply)
                   for server in range(self._link.num_servers)]
        return Handle.joined(handles)

    def ensure_open(self) -> None:
        if self._link.closed:
            raise PsrtError("psrt was shut down on this worker: the KVStore is closed")

    def track(self, handle: Handle) -> Handle:
        """Remember ``handle`` until it is settled, so that :meth:`finish` can finish it."""
        with self._link.lock:
            if len(self._open) > _KEPT_SETTLED:  # forget the settled: waited for, or sent with nothing to hear
                self._open = [h for h in self._open if not (h.finished or (not h._replies and h.done()))]
            self._open.append(handle)
        return handle

    def finish(self) -> None:
        """Wait for every request nobody waited for, printing what failed."""
        for handle in self._open:
            if not handle.finished:
                try:
                    handle.wait()
                except PsrtError as e:
                    print(f"psrt: worker {self._link.worker}: a request nobody waited for failed: {e}",
                          file=sys.stderr, flush=True)
        self._open = []
