"""Waiting on other ranks without taking a core from the rank's own work.

An MPI wait spins: on a host with fewer cores than ranks (the 2-core CI box runs 3 or 4
ranks, a parameter server shares its host with workers) a spinning rank takes the CPU
the rank it waits for needs to get there.  Every wait psrt runs itself (the engine's
negotiation messages, a parameter server's loop, the direct layer's collectives and
messages) therefore spins only briefly, which catches the common case of a reply that is
microseconds away, and then sleeps in naps that double up to a fifth of a millisecond,
which bounds the latency a nap can add.
"""
from __future__ import annotations

import time

from psrt.comm.base import Request

SPIN_S = 100e-6
FIRST_NAP_S = 20e-6
LONGEST_NAP_S = 200e-6


class Backoff:
    """Paces a loop that polls: :meth:`idle` after a turn that found nothing to do (it
    returns at once while the loop is within its spin, sleeps once past it), :meth:`busy`
    after a turn that did something (the next idle turn spins again)."""

    __slots__ = ("_spin_until", "_nap")

    def __init__(self) -> None:
        self._spin_until = 0.0
        self._nap = 0.0

    def busy(self) -> None:
        self._nap = 0.0

    def idle(self) -> None:
        if not self._nap:
            self._spin_until, self._nap = time.perf_counter() + SPIN_S, FIRST_NAP_S
        elif time.perf_counter() > self._spin_until:
            time.sleep(self._nap)
            self._nap = min(self._nap * 2, LONGEST_NAP_S)


def wait_politely(request: Request) -> None:
    """Return once ``request`` has completed, spinning first and then napping."""
    backoff = Backoff()
    while not request.test():
        backoff.idle()
