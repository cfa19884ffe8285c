"""The engine's doorbell (psrt/engine/doorbell.py) over an in-process fake transport: a ring
wakes the rank quiet in that epoch, and rings left over from earlier epochs never do."""
from __future__ import annotations

import torch

from psrt.comm.base import ANY_SOURCE, CompletedRequest, Request
from psrt.engine.doorbell import Doorbell


class _Mailbox:
    """Messages in flight between the fake ranks, in order."""

    def __init__(self) -> None:
        self.messages: list[tuple[int, int, torch.Tensor]] = []  # (source, dest, payload)


class _Receive(Request):
    def __init__(self, box: _Mailbox, rank: int, into: torch.Tensor) -> None:
        self._box, self._rank, self._into = box, rank, into
        self.cancelled = False

    def test(self) -> bool:
        for message in self._box.messages:
            if message[1] == self._rank:
                self._box.messages.remove(message)
                self._into.copy_(message[2])
                return True
        return False

    def wait(self) -> None:
        raise AssertionError("the doorbell must never block on a receive")

    def cancel(self) -> None:
        self.cancelled = True


class _FakeComm:
    def __init__(self, box: _Mailbox, rank: int, size: int) -> None:
        self._box, self.rank, self.size = box, rank, size
        self.receives: list[_Receive] = []
        self.freed = False

    def isend(self, tensor: torch.Tensor, dest: int, tag: int = 0) -> Request:
        self._box.messages.append((self.rank, dest, tensor.clone()))
        return CompletedRequest()

    def irecv(self, tensor: torch.Tensor, source: int, tag: int = 0) -> Request:
        assert source == ANY_SOURCE
        self.receives.append(_Receive(self._box, self.rank, tensor))
        return self.receives[-1]

    def free(self) -> None:
        self.freed = True


def _bells(size: int) -> tuple[_Mailbox, list[_FakeComm], list[Doorbell]]:
    box = _Mailbox()
    comms = [_FakeComm(box, rank, size) for rank in range(size)]
    return box, comms, [Doorbell(comm) for comm in comms]


def test_a_ring_wakes_every_other_rank_quiet_in_that_epoch():
    _, _, bells = _bells(3)
    assert not any(bell.rang(5) for bell in bells)
    bells[1].ring(5)
    assert bells[0].rang(5) and bells[2].rang(5)
    assert not bells[1].rang(5), "a rank does not ring itself"


def test_rings_for_an_earlier_epoch_are_dropped():
    _, _, bells = _bells(2)
    bells[0].ring(3)  # both ranks left epoch 3 by themselves: this ring was never needed
    bells[0].ring(3)
    assert not bells[1].rang(7), "a ring left over from epoch 3 woke a rank quiet in epoch 7"
    bells[0].ring(7)
    assert bells[1].rang(7)


def test_close_withdraws_the_posted_receive_and_frees_the_communicator():
    _, comms, bells = _bells(2)
    bells[1].rang(1)  # posts the receive
    bells[1].close()
    assert comms[1].receives[-1].cancelled and comms[1].freed
