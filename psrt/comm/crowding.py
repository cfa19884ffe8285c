"""Whether a rank shares its cores, so that psrt's waits nap instead of spinning.

A waiting rank that spins keeps its core.  On a host with a core to spare per rank that is
the fastest way to wait; on a crowded one (data-loader workers, a tokenizer, a second job,
more ranks than cores) the spin takes the core that the rank it waits for, or the other
work, needs, and a step slows to the scheduler's time slices.  gloo waits in the kernel
and loses nothing there.  So psrt's waits (:mod:`psrt.comm.poll`, MPI requests and large
allreduces in :mod:`psrt.comm.mpi`, the ring's exchanges) nap without spinning while the
host is crowded (:func:`crowded`).

Crowded means: this process's main thread, the one that trains, spent more than
:data:`CROWDED_SHARE` of the time between two checks at least :data:`RECHECK_S` apart
runnable but waiting for a core (Linux's ``run_delay`` in ``/proc/self/schedstat``).  On a
2-core host with two ranks that share was 0.01-0.02 while they trained alone, about 0.1
while they waited in gloo's collectives (each wake-up waits a little), and 0.4-0.5 with
a busy process beside each rank or with 4 ranks, napping or spinning alike.  Host-wide
figures do not tell: the job's own engine, watchdog and gloo threads waking beside two
spinning ranks kept half the time stalled in Linux's CPU pressure on the idle host.  Where
the kernel keeps no scheduler statistics, runnable tasks are counted against the cores
instead.  ``PSRT_WAITS`` (``Config.waits``) overrides the
verdict: ``spin`` never takes the crowded ways, ``nap`` always does.

MPI's own setting for this, Open MPI's ``mpi_yield_when_idle`` (``sched_yield`` in its
progress loop), is left alone: a yielding rank gives its core to the other work for a whole
time slice, and with it DDP over psrt and ``DistributedOptimizer`` ran at about half their
speed on a crowded host; MPICH's progress throttle gained nothing either (benchmarks/RESULTS.md,
"Crowded hosts").
"""
from __future__ import annotations

import math
import os
import time

__all__ = ["CROWDED_SHARE", "RECHECK_S", "configure", "crowded", "usable_cores"]

#: Share of the time the main thread spent waiting for a core, above which the host counts
#: as crowded.
CROWDED_SHARE = 0.25
RECHECK_S = 0.5
_SCHEDSTAT = "/proc/self/schedstat"  # the process's main thread's, whichever thread reads it
_LOADAVG = "/proc/loadavg"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of them under ``--bind-to none``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _main_thread_times() -> tuple[int, int] | None:
    """(ns on a core, ns waiting for one) of this process's main thread since it started, or
    None where the kernel keeps no scheduler statistics."""
    try:
        with open(_SCHEDSTAT) as f:
            on_core, waiting = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_core), int(waiting)


def _runnable_beyond_cores() -> bool:
    """Without scheduler statistics: whether more tasks are runnable now than there are cores
    (the count includes the reader itself)."""
    try:
        with open(_LOADAVG) as f:
            running = int(f.read().split()[3].partition("/")[0])
    except (OSError, IndexError, ValueError):
        return False
    return running > usable_cores()


class _Crowding:
    """The last verdict, until when it holds, and when it was reached with the main thread's
    time spent waiting for a core then; one per process, read by every thread (a stale
    verdict only makes a wait spin or nap a little longer than it should)."""

    __slots__ = ("verdict", "until", "_at", "_waited")

    def __init__(self) -> None:
        self.verdict, self.until = False, 0.0
        self._at, self._waited = 0.0, None

    def configure(self, waits: str) -> None:
        """``Config.waits``: "spin" and "nap" fix the verdict, "auto" measures it."""
        self.verdict, self.until = waits == "nap", math.inf if waits in ("spin", "nap") else 0.0

    def crowded(self) -> bool:
        now = time.monotonic()
        if now < self.until:
            return self.verdict
        self.until = now + RECHECK_S
        times = _main_thread_times()
        if times is None:
            self.verdict = _runnable_beyond_cores()
            return self.verdict
        if self._waited is not None:
            self.verdict = (times[1] - self._waited) / 1e9 > CROWDED_SHARE * (now - self._at)
        self._at, self._waited = now, times[1]
        return self.verdict


_CROWDING = _Crowding()
crowded, configure = _CROWDING.crowded, _CROWDING.configure
