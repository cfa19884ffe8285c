"""Messages of device tensors between the members of a direct group, without the host waiting
for the device.

A message still begins with the direct layer's header (message id, dtype, shape: see
:meth:`~psrt.comm.direct.DirectGroup.send_header`), sent over the group's host communicator
when the message is posted, so that a receiver can allocate from it and a disagreement is an
error naming both sides.  The payload goes over the group's device transport (NCCL), and
ordered with compute as :mod:`psrt.comm.streams` says: posting records a *ready* event on the
caller's current stream (the payload is computed, a receive buffer's memory is free), the
stream the caller names waits for it, the transfer runs there, and waiting on the message
makes the waiting thread's current stream wait for the *done* event after it.  The tensors
stay referenced by the message until then.

NCCL's sends block until their receiver takes them, match a pair's messages by order alone,
and one communicator runs its calls one after another: two ranks that each send and then
receive from the other would each wait for a receive queued behind their own send.  So posting
and issuing are apart: :meth:`DeviceMessages.issue` sends a caller's choice of posted messages
as one NCCL group, which progresses as a whole (a pipeline issues its messages round by round,
:mod:`psrt.pp.rounds`; the torch backend whatever is posted when a work is waited for).  Where
the members share a GPU the transport stages through host memory instead
(:mod:`psrt.comm.staged`, with its own named host waits), over the tag ``max_tag``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from psrt.comm import streams
from psrt.comm.base import Request
from psrt.comm.direct import DirectGroup
from psrt.comm.header import Header, Kind
from psrt.comm.waits import Text
from psrt.errors import CollectiveMismatchError, CommunicationError, UnsupportedOperationError


class DeviceMessage(Request):
    """One posted send or receive of a device tensor (:class:`DeviceMessages`).  Waiting makes
    the caller's current stream wait for the group that carried it; a receive whose sender
    sent another dtype or shape raises then, naming both."""

    __slots__ = ("sends", "tensor", "peer", "tag", "ready", "header", "posted", "issued", "error", "kind", "what")

    def __init__(self, sends: bool, tensor: torch.Tensor, peer: int, tag: int, ready: object, *,
                 header: Header | None = None, posted: Request | None = None, kind: str = "", what: Text = "") -> None:
        self.sends, self.tensor, self.peer, self.tag, self.ready = sends, tensor, peer, tag, ready
        self.header, self.posted = header, posted  # posted: a send's header on its way
        self.kind, self.what = kind, what  # how a receive's wait for its header is marked
        self.issued: Request | None = None
        self.error: BaseException | None = None

    def test(self) -> bool:
        return self.issued is not None and self.issued.test() and (self.posted is None or self.posted.test())

    def wait(self) -> None:
        if self.issued is None:
            raise CommunicationError(f"a device message to or from rank {self.peer} (tag {self.tag}) was waited "
                                     "for before it was issued")
        if self.posted is not None:
            self.posted.wait()  # the header: small, sent at once over MPI
        self.issued.wait()  # the current stream waits; the host goes on
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        raise UnsupportedOperationError("a device message cannot be withdrawn")


class DeviceMessages:
    """Sends and receives of tensors on ``device`` between the members of ``group``, carried
    on ``stream`` (a communication stream: the device's point-to-point one, or a group's own).
    Made collectively over the group (the device transport is made on first use); used by one
    thread at a time; members issue a pair's messages in the same order on both ends."""

    def __init__(self, group: DirectGroup, device: torch.device, stream: object) -> None:
        self._group, self._device, self._stream = group, device, stream
        self._transport = group.transport(device)

    def send(self, tensor: torch.Tensor, dest: int, tag: int, ident: int = 0) -> DeviceMessage:
        """Post sending ``tensor`` to member ``dest``: its header goes now, its payload when
        issued (held until the message is waited for; the caller leaves it unchanged)."""
        payload = tensor.detach().contiguous()
        posted = self._group.send_header(payload, dest, tag, ident)
        cuda = streams.api()
        return DeviceMessage(True, payload, dest, tag, cuda.record(cuda.current(self._device)), posted=posted)

    def recv(self, tensor: torch.Tensor, source: int, tag: int, header: Header | None = None, *,
             kind: str = "a device receive", what: Text = "") -> DeviceMessage:
        """Post receiving the next message from member ``source`` on ``tag`` into the
        contiguous ``tensor``.  ``header``: its header, already taken and checked by the
        caller; else it is taken when the message is issued (a wait marked as
        ``kind``/``what``) and must describe ``tensor``."""
        cuda = streams.api()
        return DeviceMessage(False, tensor, source, tag, cuda.record(cuda.current(self._device)), header=header,
                             kind=kind, what=what)

    def issue(self, messages: Sequence[DeviceMessage]) -> None:
        """Issue ``messages`` (posted, not yet issued) as one group on the stream, after their
        ready events; the host never waits for the device here (a receive's header may still
        be on its way: that wait is for the sender's host, marked for the watchdog)."""
        for message in messages:
            if not message.sends and message.header is None:
                self._take_header(message)
        cuda = streams.api()
        for ready in {id(m.ready): m.ready for m in messages}.values():
            cuda.wait(self._stream, ready)
        with cuda.using(self._stream):
            issued = self._transport.isendrecv([(m.tensor, m.peer) for m in messages if m.sends],
                                               [(m.tensor, m.peer) for m in messages if not m.sends],
                                               tag=self._transport.max_tag)
        for message in messages:
            message.issued = issued

    def _take_header(self, message: DeviceMessage) -> None:
        """A receive's header, checked against its tensor.  A message of another dtype or shape
        is still taken off the link (into memory of its own), so that none is left behind for a
        later receive; its error is raised when the receive is waited for."""
        group = self._group
        got = group.recv_header(message.peer, message.tag, kind=message.kind, what=message.what)
        room = Header.of(Kind.MESSAGE, message.tensor)
        message.header = got
        if (got.dtype, tuple(got.shape)) != (room.dtype, tuple(room.shape)):
            sender = group.ranks[message.peer]
            message.error = CollectiveMismatchError(
                f"a receive on rank {group.ranks[group.rank]} from rank {sender} over {group.name} (tag {message.tag}) "
                f"expects a {room.describe_tensor()} but rank {sender} sent a {got.describe_tensor()}")
            message.tensor = torch.empty(got.shape, dtype=got.dtype, device=self._device)
            cuda = streams.api()
            message.ready = cuda.record(cuda.current(self._device))
