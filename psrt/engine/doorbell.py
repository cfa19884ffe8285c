"""The doorbell: how a rank with new work wakes engines that stopped negotiating.

Negotiation rounds are collective, so an engine cannot simply stop holding them
when it has nothing to do: another rank's collective needs it (to say it is not
ready yet, to take part as a non-member of the set, to contribute a joined
rank's zeros).  Instead, when a round shows that no rank holds any work, every
rank knows it at once and goes quiet together, at the same round: the *quiet
epoch*, that round's number.  A rank that later has work negotiates, and rings
the ranks that must join its round without work of their own (one tiny message
each, carrying the epoch it leaves; which ranks, and when, is the engine's
choice); a quiet rank polls its one posted receive, slowly, and negotiates once
rung.  So an idle engine sends nothing and wakes only to look at one request.

Several ranks may ring for the same epoch; each rings and is rung, and the
rings it never needed arrive later, carrying an older epoch than the one
their receiver is quiet in, and are dropped.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from psrt.comm.base import ANY_SOURCE, Communicator, Request

_TAG = 7


class Doorbell:
    """One rank's bell: ring the others, or learn whether they rang for an epoch."""

    def __init__(self, comm: Communicator) -> None:
        """``comm`` spans the engine's world and carries nothing else."""
        self._comm = comm
        self._others = [r for r in range(comm.size) if r != comm.rank]
        self._heard = torch.zeros(1, dtype=torch.int64)
        self._listening: Request | None = None
        self._sends: list[tuple[Request, torch.Tensor]] = []

    def ring(self, epoch: int, ranks: Sequence[int] | None = None) -> None:
        """Tell ``ranks`` (default every other rank) that this one leaves quiet epoch
        ``epoch``; ringing a rank twice for an epoch is harmless."""
        self._sends = [(r, t) for r, t in self._sends if not r.test()]
        message = torch.tensor([epoch], dtype=torch.int64)
        self._sends += [(self._comm.isend(message, rank, _TAG), message)
                        for rank in (self._others if ranks is None else ranks)]

    def rang(self, epoch: int) -> bool:
        """Whether some rank rang for ``epoch``, dropping rings for earlier epochs."""
        while True:
            if self._listening is None:
                self._listening = self._comm.irecv(self._heard, ANY_SOURCE, _TAG)
            if not self._listening.test():
                return False
            self._listening = None
            if int(self._heard) >= epoch:
                return True

    def close(self) -> None:
        """Withdraw the posted receive and free the communicator (every rank has stopped
        negotiating, so no ring that matters is still on its way)."""
        if self._listening is not None:
            self._listening.cancel()
            self._listening = None
        for request, _ in self._sends:
            request.wait()
        self._comm.free()
