"""Waiting on other ranks without taking a core from the rank's own work.

An MPI wait spins: on a host with fewer cores than ranks (the 2-core CI box runs 3 or 4
ranks, a parameter server shares its host with workers) a spinning rank takes the CPU
the rank it waits for needs to get there.  Every wait psrt runs itself (the engine's
negotiation messages, a parameter server's loop, its workers' requests, the direct
layer's messages) therefore spins only briefly, which catches the common case of a
reply that is microseconds away, and then sleeps in naps that double up to a fifth of a
millisecond, which bounds the latency a nap can add.  (Offering the core at every turn
of the spin instead, with ``sched_yield``, measured worse: a 64 KiB parameter-server
pull on 3 ranks sharing 2 cores took 0.8 ms against 0.3 ms.)

On a crowded host (:func:`psrt.comm.crowding.crowded`: some runnable task keeps waiting for
a core) the spin only takes the core from the rank being waited for, so the first idle turn
naps at once.

A napping thread asks Linux for a timer slack of one microsecond: with the default of
50 µs a nap of 20 µs lasts about 75, and every nap would add that much latency.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import time

from psrt.comm.base import Request
from psrt.comm.crowding import crowded

SPIN_S = 100e-6
FIRST_NAP_S = 20e-6
LONGEST_NAP_S = 200e-6
_PR_SET_TIMERSLACK = 29
_SLACK_NS = 1000
_fine_timers = threading.local()  # whether this thread has asked for its timer slack


class Backoff:
    """Paces a loop that polls: :meth:`idle` after a turn that found nothing to do (it
    returns at once while the loop is within its spin, sleeps once past it or on a crowded
    host), :meth:`busy` after a turn that did something (the next idle turn starts a new
    spin)."""

    __slots__ = ("_nap", "_spin_until")

    def __init__(self) -> None:
        self._spin_until = 0.0
        self._nap = 0.0

    def busy(self) -> None:
        self._nap = 0.0

    def idle(self) -> None:
        if not self._nap:
            self._spin_until, self._nap = time.perf_counter() + (0.0 if crowded() else SPIN_S), FIRST_NAP_S
        elif time.perf_counter() >= self._spin_until:
            if not getattr(_fine_timers, "asked", False):
                _ask_for_fine_timers()
            time.sleep(self._nap)
            self._nap = min(self._nap * 2, LONGEST_NAP_S)


def wait_politely(request: Request) -> None:
    """Return once ``request`` has completed, spinning first and then napping."""
    backoff = Backoff()
    while not request.test():
        backoff.idle()


def _ask_for_fine_timers() -> None:
    _fine_timers.asked = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, _SLACK_NS, 0, 0, 0)
        except (OSError, AttributeError):  # no C library to ask: naps are only longer
            pass
