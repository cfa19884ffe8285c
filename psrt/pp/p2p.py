"""Activations and their gradients between neighbouring pipeline stages.

Every message is a direct-layer message (:meth:`psrt.comm.direct.DirectGroup.send`): a
header (message id, dtype, shape) followed by the payload, on the PP set's own direct group
(not the engine's communicator).  The receiver allocates from the header, so it never
needs to know shapes in advance, and checks the id against what its schedule expects next
and, for gradients, the shape against the activation it sent: a disagreement between
stages is an error naming both sides, never a truncated buffer or a hang.

Sends never block and receives do: the execution model the schedule checker
proves deadlock-free.  That holds for host tensors over MPI.  Device tensors (CUDA's) keep
the header over MPI but their payload goes over NCCL on the device's point-to-point stream
(:mod:`psrt.comm.device_messages`), whose sends do block until the peer receives: a step
posts each message at its action and issues them round by round, one NCCL group per round
(:mod:`psrt.pp.rounds` numbers them so that no schedule deadlocks), and the compute stream
waits for a receive's group before using it, never the host.  A shared parameter's value and
gradient (once per step) still travel through host memory.
"""
from __future__ import annotations

from collections import Counter

import torch

from psrt.comm import streams
from psrt.comm.base import Request
from psrt.comm.device_messages import DeviceMessage, DeviceMessages
from psrt.comm.direct import DirectGroup
from psrt.comm.header import MAX_DIMS, Header
from psrt.errors import CommunicationError
from psrt.pp.schedule import Action

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FORWARD_TAG, BACKWARD_TAG = 11, 12
TIED_VALUE_TAG, TIED_GRADIENT_TAG = 13, 14  # a shared parameter's value, owner to copy; its gradient back


def message_id(microbatch: int, stage: int) -> int:
    """What a message carries, as one int: the micro-batch and the sending virtual stage."""
    return microbatch * 1_000_000 + stage


def describe_id(ident: int) -> str:
    microbatch, stage = divmod(ident, 1_000_000)
    return f"micro-batch {microbatch} from virtual stage {stage}"


def _check_sendable(tensor: torch.Tensor) -> None:
    if tensor.dtype not in _FLOATS or tensor.dim() > MAX_DIMS:
        raise CommunicationError(f"pipeline stages exchange floating-point tensors of at most {MAX_DIMS} "
                                 f"dimensions, got {tensor.dtype} of shape {tuple(tensor.shape)}")


class StageLink:
    """Sends and receives of one pipeline rank over the PP process set."""

    def __init__(self, group: DirectGroup) -> None:
        """Messages go over the PP set's direct group, made with the set: nothing is opened here."""
        self._group = group
        self._devices: dict[torch.device, DeviceMessages] = {}

    def on_device(self, device: torch.device) -> DeviceMessages | None:
        """The device messages of tensors on ``device`` (None for host memory).  Collective over
        the set the first time (the device transport is made then): every stage calls it at
        the same point of a step."""
        if not streams.api().covers(device):
            return None
        messages = self._devices.get(device)
        if messages is None:
            messages = self._devices[device] = DeviceMessages(self._group, device,
                                                              streams.device_streams(device).p2p)
        return messages

    def send(self, tensor: torch.Tensor, dest: int, tag: int, ident: int) -> Request:
        """Start sending ``tensor`` to set rank ``dest`` over MPI (a device tensor through host
        memory: a shared parameter's); keep the request until it completes."""
        _check_sendable(tensor)
        payload = tensor.detach()
        return self._group.send(payload.cpu() if payload.is_cuda else payload, dest, tag, ident)

    def post_send(self, messages: DeviceMessages, tensor: torch.Tensor, dest: int, tag: int,
                  ident: int) -> DeviceMessage:
        """Post sending the device ``tensor`` to set rank ``dest`` (issued with its round)."""
        _check_sendable(tensor)
        return messages.send(tensor, dest, tag, ident)

    def recv_tied(self, source: int, tag: int, index: int, like: torch.Tensor) -> torch.Tensor:
        """A shared parameter's value or gradient (``tag``) from set rank ``source``; it must be
        shared parameter ``index`` and have ``like``'s shape and dtype."""
        group, what = self._group, "value" if tag == TIED_VALUE_TAG else "gradient"
        header, tensor = group.recv(source, tag, kind="a shared parameter",
                                    what=lambda: f"pipeline rank {group.rank}'s receive of shared parameter {index}'s "
                                                 f"{what} from pipeline rank {source}")
        if header.ident != index or header.shape != tuple(like.shape) or header.dtype != like.dtype:
            raise CommunicationError(
                f"pipeline rank {group.rank} expected the {what} of shared parameter {index} ({tuple(like.shape)}, "
                f"{like.dtype}) from rank {source}, which sent shared parameter {header.ident} ({header.shape}, "
                f"{header.dtype}): the stages were built from different models")
        return tensor.to(like.device)

    def recv(self, source: int, tag: int, ident: int, device: torch.device,
             like: torch.Tensor | None = None) -> torch.Tensor:
        """Receive the next message from set rank ``source``; it must be ``ident`` and, when
        ``like`` is given, have its shape and dtype."""
        # the payload is taken off the link even when it is refused, so nothing is left behind
        # for a later receive to match
        header, tensor = self._group.recv(source, tag, kind="a pipeline message", what=self._what(ident, source))
        self._check(header, source, ident, like)
        return tensor.to(device)

    def post_recv(self, messages: DeviceMessages, source: int, tag: int, ident: int, device: torch.device,
                  like: torch.Tensor | None = None) -> tuple[torch.Tensor, DeviceMessage]:
        """Post receiving the next message from set rank ``source`` into a new tensor on
        ``device`` (checked as :meth:`recv` checks; usable once the message is waited for)."""
        header = self._group.recv_header(source, tag, kind="a pipeline message", what=self._what(ident, source))
        try:
            self._check(header, source, ident, like)
        except CommunicationError:  # refused, but taken off the link: nothing is left for a later receive
            refused = torch.empty(header.shape, dtype=header.dtype, device=device)
            messages.issue([messages.recv(refused, source, tag, header)])
            raise
        tensor = torch.empty(header.shape, dtype=header.dtype, device=device)
        return tensor, messages.recv(tensor, source, tag, header)

    def _what(self, ident: int, source: int):
        group = self._group
        return lambda: (f"pipeline rank {group.rank}'s receive of {describe_id(ident)} from pipeline rank "
                        f"{source} (world rank {group.ranks[source]})")

    def _check(self, header: Header, source: int, ident: int, like: torch.Tensor | None) -> None:
        """The message must be ``ident`` and, when ``like`` is given, of its shape and dtype."""
        rank = self._group.rank
        if header.ident != ident:
            raise CommunicationError(f"pipeline rank {rank} expected {describe_id(ident)} but rank "
                                     f"{source} sent {describe_id(header.ident)}: the stages run different schedules")
        if like is not None and (header.shape != tuple(like.shape) or header.dtype != like.dtype):
            raise CommunicationError(
                f"pipeline rank {rank}: the gradient of {describe_id(ident)} from rank {source} has "
                f"shape {header.shape} ({header.dtype}) but the activation it belongs to has shape "
                f"{tuple(like.shape)} ({like.dtype})")


class RoundIssuer:
    """One step's device messages on this rank, issued round by round (:mod:`psrt.pp.rounds`):
    a round goes as one NCCL group once all its messages here are posted, after every earlier
    round.  A receive completes its round (it is used at once), so it is issued when posted."""

    def __init__(self, messages: DeviceMessages, rounds: dict[Action, int]) -> None:
        self._messages, self._rounds = messages, rounds
        self._sizes = Counter(rounds.values())
        self._order = sorted(self._sizes)
        self._next = 0
        self._posted: dict[int, list[DeviceMessage]] = {}

    def post(self, action: Action, message: DeviceMessage) -> DeviceMessage:
        self._posted.setdefault(self._rounds[action], []).append(message)
        while self._next < len(self._order):
            round_ = self._order[self._next]
            if len(self._posted.get(round_, ())) < self._sizes[round_]:
                break
            self._messages.issue(self._posted.pop(round_))
            self._next += 1
        return message

    @property
    def finished(self) -> bool:
        """Whether every round has been issued."""
        return self._next == len(self._order)
