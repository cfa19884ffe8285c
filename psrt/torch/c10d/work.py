"""The ``Work`` objects psrt's process group hands back to torch.

Collectives run on the caller's thread (:mod:`psrt.torch.c10d.group`), so a host
collective's work is finished when it is made; a CUDA collective is enqueued on the current
stream, and its work carries that point of the stream.  Sends and receives are the only
pending works: they wait for MPI's requests, marked for the watchdog.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from psrt.comm.base import Request
from psrt.comm.direct import DirectGroup


def completed(outputs: list[torch.Tensor], tensor: torch.Tensor | None) -> dist.Work:
    """The work of a collective that ran on this thread over ``tensor`` (None: no data).
    On the host it is finished; on CUDA its future records the current stream, and waiting
    on it makes the waiting stream wait for that point, as NCCL's works do."""
    if tensor is None or not tensor.is_cuda:  # is_cuda: a sixth of device.type's cost
        return HostWork((), outputs)
    future = torch.futures.Future(devices=[tensor.device])
    future.set_result(outputs)
    return _create_work_from_future(future)


class HostWork(dist.Work):
    """Host work: finished when made (a collective), or once MPI's ``requests`` complete (a
    send or a receive), after which ``after`` runs (copying a receive into its tensor).
    A Python ``Work`` costs a fifth of one made from a future, which matters on every small
    collective; the future is made only when asked for."""

    def __init__(self, requests: Sequence[Request], outputs: list[torch.Tensor],
                 after: Sequence[Callable[[], object]] = ()) -> None:
        super().__init__()
        self._requests, self._outputs, self._after = requests, outputs, after

    def wait(self, timeout: object = None) -> bool:
        if self._requests or self._after:
            for request in self._requests:
                request.wait()
            for finish in self._after:
                finish()
            self._requests, self._after = (), ()
        return True

    def is_completed(self) -> bool:
        """Whether the outputs are in place (a receive's copy is made here once its data is in)."""
        if self._requests and not all([request.test() for request in self._requests]):
            return False
        self.wait()
        return True

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future


class Marked(Request):
    """A request whose wait is marked for the watchdog as waiting on one peer (a send)."""

    def __init__(self, direct: DirectGroup, request: Request, kind: str, what: str, peer: int) -> None:
        self._direct, self._request, self._kind, self._what, self._peer = direct, request, kind, what, peer

    def test(self) -> bool:
        return self._request.test()

    def wait(self) -> None:
        self._direct.wait(self._request, self._kind, self._what, (self._peer,))

    def cancel(self) -> None:
        self._request.cancel()
