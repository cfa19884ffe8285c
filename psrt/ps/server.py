"""The parameter server's event loop: one per server rank, serving every worker at once.

The loop never blocks on one worker.  It keeps one header receive posted per worker and
one push receive per worker and chunk (:mod:`psrt.ps.pushes`), starts the receives and
sends each request needs, and in every turn applies the pushes and answers the pulls that
the consistency mode allows; between turns with nothing to do it spins, then naps
(:class:`psrt.comm.poll.Backoff`).  An error in one request is answered to the worker that
sent it (at once for requests with a reply; for a push, with the worker's next reply about
the same store, or printed here if the worker has left), never swallowed.  What the server
holds back (requests waiting for other workers, data still arriving) is published to the
watchdog once a second, which reports it, naming the workers waited for, after
``PSRT_STALL_CHECK_TIME`` and ends the job after ``PSRT_STALL_SHUTDOWN_TIME`` (see
:mod:`psrt.ps.stalls`).  The watchdog's probe answers also say, for each request held, which
workers it waits for (:meth:`Server.holds`), so that a worker blocked in a request that the
others never serve is found in a deadlock within seconds (:mod:`psrt.comm.deadlock`).

The loop decides when to look; what each request does to the stores is
:mod:`psrt.ps.handler`'s, and how a message to or from a worker travels is
:mod:`psrt.ps.replies`'.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from psrt.comm.base import Communicator, Persistent, Request
from psrt.comm.header import HEADER_WORDS, Header
from psrt.comm.poll import Backoff
from psrt.comm.waits import Wait
from psrt.comm.watchdog import Watchdog, combined
from psrt.config import Config
from psrt.ps import protocol, stalls
from psrt.ps.handler import RequestHandler
from psrt.ps.protocol import RequestKind
from psrt.ps.pushes import PostedPushes
from psrt.ps.replies import Replies
from psrt.ps.roles import Roles

_STALL_SCAN_S = 1.0
# How long a probe answer waits for the loop to finish its turn before saying it cannot tell
# what it holds (a turn may save a checkpoint or run a large update).
_HOLDS_WITHIN_S = 0.05


class Server:
    """Serves the workers of ``roles`` over ``comm`` until all of them have shut down."""

    def __init__(self, comm: Communicator, roles: Roles, config: Config, watchdog: Watchdog,
                 abort: Callable[[str], None]) -> None:
        self.comm, self.roles, self.config = comm, roles, config
        self._watchdog = watchdog
        self.index = roles.server_index(comm.rank)
        self.num_workers = len(roles.workers)
        # per worker still connected: the words its next header arrives in (a numpy view, read
        # faster), the persistent receive into them, and its current start
        self._headers: dict[int, tuple[np.ndarray, Persistent, Request]] = {}
        self._pushes = PostedPushes(comm, roles.workers)
        self._replies = Replies(comm, roles.workers, self.name)
        self._handler = RequestHandler(self._replies, self._pushes, name=self.name, index=self.index,
                                       num_servers=len(roles.servers), num_workers=self.num_workers,
                                       max_tag=comm.max_tag, abort=abort)
        self._next_stall_scan = time.monotonic() + _STALL_SCAN_S
        self._turning = threading.Lock()  # held during a turn: holds() reads the state between turns

    @property
    def name(self) -> str:
        return f"parameter server {self.index} (rank {self.comm.rank})"

    def serve(self) -> None:
        self._listen()
        self._watchdog.hold(self.holds)
        backoff = Backoff()
        while not self._finished():
            with self._turning:
                progressed = self._turn()
            if progressed:
                backoff.busy()
            else:
                backoff.idle()
            if time.monotonic() >= self._next_stall_scan:
                self._scan_for_stalls()
        self._watchdog.hold(None)
        self._watchdog.publish("parameter server", ())
        self._handler.report_unfinished_steps()

    def holds(self) -> list | None:
        """What each request held waits for (:func:`psrt.ps.stalls.holds`), read between two
        turns of the loop; None if a turn does not end soon.  Called on the watchdog's thread."""
        if not self._turning.acquire(timeout=_HOLDS_WITHIN_S):
            return None
        try:
            handler = self._handler
            return stalls.holds(handler.stores, handler.gathering, handler.active, self.roles.workers)
        finally:
            self._turning.release()

    def _listen(self) -> None:
        """Post the receive of every worker's first header."""
        for worker in range(self.num_workers):
            words = torch.empty(HEADER_WORDS, dtype=torch.int64)
            receive = self.comm.persistent_recv(words, self.roles.workers[worker], protocol.HEADER_TAG)
            self._headers[worker] = (words.numpy(), receive, receive.start())

    def _turn(self) -> bool:
        """One turn of the loop: take in what arrived, answer what may be answered; whether
        anything happened.  Only what may have changed is looked at: an idle turn is cheap."""
        handler = self._handler
        progressed = self._poll_headers()
        if self._pushes.watching:
            touched = self._pushes.poll()
            handler.touched.update(touched)
            progressed |= bool(touched)
        if self._replies.inflight:
            progressed |= self._replies.poll()
        if handler.waiting():
            progressed |= handler.advance()
        return progressed

    def _finished(self) -> bool:
        handler = self._handler
        return len(handler.departed) == self.num_workers and not self._replies.inflight \
            and not self._pushes.open_slots and not handler.holds_pulls()

    def _poll_headers(self) -> bool:
        """Dispatch every header that has arrived (a worker's in the order it sent them),
        starting the receive of each worker's next one into the same buffer (a persistent
        receive: a start costs a microsecond or two, posting a receive several times that)."""
        progressed = False
        for worker, (view, receive, request) in list(self._headers.items()):
            while request.test():
                header = Header.decode(view.tolist())
                if header.kind == RequestKind.BYE:
                    del self._headers[worker]
                    receive.free()
                else:
                    request = receive.start()
                    self._headers[worker] = (view, receive, request)
                self._handler.dispatch(worker, header)
                progressed = True
                if header.kind == RequestKind.BYE:
                    break
        return progressed

    def _scan_for_stalls(self) -> None:
        """Tell the watchdog what is held back, and what is still under way, now."""
        now = time.monotonic()
        self._next_stall_scan = now + _STALL_SCAN_S
        workers, handler = self.roles.workers, self._handler
        held = list(stalls.waits(handler.stores, handler.gathering, handler.active, workers))
        under_way = self._replies.under_way()
        under_way += [(worker, since, "receive") for worker, since in self._pushes.waiting()]
        held += [Wait(stalls.KIND, f"a {direction} of a message with worker {worker}", [workers[worker]], since)
                 for worker, since, direction in under_way if now - since >= self.config.stall_check_time_s / 2]
        self._watchdog.publish("parameter server", combined(stalls.KIND, held, key="parameter server",
                                                            prefix=f"{self.name} holds "))
