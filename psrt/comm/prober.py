"""Asking other ranks what they wait for, and answering them: the watchdog's only traffic.

A rank's watchdog thread probes the ranks a stalled wait, or a blocked call, waits on (see
:mod:`psrt.comm.watchdog` and :mod:`psrt.comm.deadlock`), and answers their probes with its
own status.  :class:`Prober` is what the watchdog needs; :class:`MpiProber` does it over a
communicator of its own.
"""
from __future__ import annotations

import json
import time
from typing import Callable, Iterable, Protocol


class Prober(Protocol):
    """Asks other ranks what they are doing, and answers them (see :class:`MpiProber`)."""

    rank: int
    size: int

    def ask(self, ranks: Iterable[int]) -> None: ...

    def serve(self, status: Callable[[], dict]) -> None: ...

    def answers(self) -> dict[int, tuple[float, dict]]: ...

    def close(self) -> None: ...


class MpiProber:
    """Probes over a private duplicate of the job's communicator: a *ping* (tag 1) is
    answered, by the probed rank's watchdog thread, with its status as UTF-8 JSON (tag 2).

    Nothing here ever blocks on another rank: pings and answers are non-blocking sends
    (to a frozen rank they simply never complete), and incoming messages are found with
    ``Iprobe`` before they are received.
    """

    _PING, _ANSWER = 1, 2

    def __init__(self, comm) -> None:  # an mpi4py communicator this class owns
        from mpi4py import MPI

        self._MPI, self._comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._sends: list[tuple[object, object]] = []  # (request, the buffer it reads)
        self._answers: dict[int, tuple[float, dict]] = {}

    def ask(self, ranks: Iterable[int]) -> None:
        for rank in ranks:
            self._send(bytearray(1), rank, self._PING)

    def _send(self, payload: bytearray, rank: int, tag: int) -> None:
        self._sends.append((self._comm.Isend([payload, self._MPI.BYTE], dest=rank, tag=tag), payload))

    def serve(self, status: Callable[[], dict]) -> None:
        """Answer every ping that has arrived, take in every answer, forget finished sends."""
        MPI, info = self._MPI, self._MPI.Status()
        answer = None  # the status, worked out once for every ping of this pass
        while self._comm.Iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=info):
            source, tag, count = info.Get_source(), info.Get_tag(), info.Get_count(MPI.BYTE)
            payload = bytearray(count)
            self._comm.Recv([payload, MPI.BYTE], source=source, tag=tag)
            if tag == self._PING:
                answer = answer or json.dumps(status()).encode()
                self._send(bytearray(answer), source, self._ANSWER)
            elif tag == self._ANSWER:
                self._answers[source] = (time.monotonic(), json.loads(payload.decode()))
        self._sends = [(request, buffer) for request, buffer in self._sends if not request.Test()]

    def answers(self) -> dict[int, tuple[float, dict]]:
        """The latest answer of each rank that answered: (when it arrived, its status)."""
        return dict(self._answers)

    def close(self) -> None:
        """Stop using the communicator.  It is kept, with every send still under way and its
        buffer, until the process ends: another rank may still ping this one, or not have
        received an answer yet, and freeing either could hand MPI freed memory."""
        _CLOSED.append((self._comm, self._sends))
        self._sends = []


#: Probers' communicators and unfinished sends, kept alive until the process ends.
_CLOSED: list[tuple[object, list]] = []
