"""The ``Work`` objects psrt's process group hands back to torch.

Collectives run on the caller's thread (:mod:`psrt.torch.c10d.group`), so a host
collective's work is finished when it is made, and host sends and receives wait for MPI's
requests, marked for the watchdog.  A CUDA collective is enqueued on the group's stream: its
:class:`StreamWork` holds the done event recorded after it and the tensors it uses, and
waiting makes the waiting thread's current stream wait for that event (never the host), as
``ProcessGroupNCCL``'s works do; its future is a CUDA future completed at that event.  A CUDA
send or receive's :class:`MessageWork` issues the group's posted messages when first waited
for, then waits likewise.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from psrt.comm import streams
from psrt.comm.base import Request
from psrt.comm.device_messages import DeviceMessage
from psrt.comm.direct import DirectGroup


def completed(outputs: list[torch.Tensor]) -> dist.Work:
    """The work of a host collective that ran on this thread: finished."""
    return HostWork((), outputs)


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


class StreamWork(dist.Work):
    """A device collective enqueued on ``stream``, ``done`` recorded after it; ``keep`` (its
    inputs) and ``outputs`` stay referenced until the work is waited for."""

    def __init__(self, device: torch.device, stream: object, done: object, outputs: list[torch.Tensor],
                 keep: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._device, self._stream, self._done, self._outputs, self._keep = device, stream, done, outputs, keep

    def wait(self, timeout: object = None) -> bool:
        """Make the calling thread's current stream wait for the collective (the host goes on)."""
        cuda = streams.api()
        cuda.wait(cuda.current(self._device), self._done)
        self._keep = ()
        return True

    def is_completed(self) -> bool:
        return streams.api().query(self._done)

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        """A future of the outputs whose waiters' streams wait for the collective (DDP's
        reducer waits on it after the backward)."""
        return streams.api().future(self._device, self._done, self._outputs)


class MessageWork(dist.Work):
    """A device send or receive, posted; ``issue`` issues the group's posted messages (this one
    among them) when the work is first waited for.  ``after`` runs once the caller's stream
    has waited (a receive's copy into a tensor that was not contiguous)."""

    def __init__(self, message: DeviceMessage, issue: Callable[[], None], outputs: list[torch.Tensor],
                 after: Sequence[Callable[[], object]] = ()) -> None:
        super().__init__()
        self._message, self._issue, self._outputs, self._after = message, issue, outputs, after
        self._device, self._waited = message.tensor.device, False

    def wait(self, timeout: object = None) -> bool:
        if not self._waited:
            if self._message.issued is None:
                self._issue()
            self._message.wait()  # a stream wait; raises if the sender sent another dtype or shape
            for finish in self._after:
                finish()
            self._waited = True
        return True

    def is_completed(self) -> bool:
        if self._message.issued is None:
            self._issue()
        if not self._message.test():
            return False
        return self.wait()

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        self.wait()
        cuda = streams.api()
        return cuda.future(self._device, cuda.record(cuda.current(self._device)), self._outputs)
