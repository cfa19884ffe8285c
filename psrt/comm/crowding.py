"""Whether a rank shares its cores, so that psrt's waits nap instead of spinning.

A waiting rank that spins keeps its core.  On a host with a core to spare per rank that is
the fastest way to wait; on a crowded one (data-loader workers, a tokenizer, a second job,
more ranks than cores) the spin takes the core that the rank it waits for, or the other
work, needs, and a step slows to the scheduler's time slices.  gloo waits in the kernel
and loses nothing there.  So psrt's waits (:mod:`psrt.comm.poll`, MPI requests and large
allreduces in :mod:`psrt.comm.mpi`, the ring's exchanges) nap without spinning while the
host is crowded (:func:`crowded`): Linux's CPU pressure (the share of time some runnable
task waited for a core) above :data:`CROWDED_PRESSURE` between two checks at least
:data:`RECHECK_S` apart.  Where the kernel keeps no pressure figures, runnable tasks are
counted against the cores instead.  ``PSRT_WAITS`` (``Config.waits``) overrides the
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

__all__ = ["CROWDED_PRESSURE", "RECHECK_S", "configure", "crowded", "usable_cores"]

#: Percent of the time in which some runnable task waited for a core, above which the host
#: counts as crowded: a rank's own threads (its engine's, gloo's) keep about 16 % of the
#: time stalled on a 2-core host with 2 ranks and nothing else; a busy process beside each
#: rank, about 90 % (benchmarks/crowded.py).
CROWDED_PRESSURE = 50.0
RECHECK_S = 0.5
_PRESSURE = "/proc/pressure/cpu"
_LOADAVG = "/proc/loadavg"


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _stalled_us() -> int | None:
    """Microseconds in which some runnable task waited for a core since boot (``some``
    ``total`` of Linux's CPU pressure), or None where the kernel keeps none."""
    try:
        with open(_PRESSURE) as f:
            first = f.readline().split()
    except OSError:
        return None
    return int(first[-1].partition("=")[2]) if first and first[0] == "some" else None


def _runnable_beyond_cores() -> bool:
    """Without pressure figures: whether more tasks are runnable now than there are cores
    (the count includes the reader itself)."""
    try:
        with open(_LOADAVG) as f:
            running = int(f.read().split()[3].partition("/")[0])
    except (OSError, IndexError, ValueError):
        return False
    return running > usable_cores()


class _Crowding:
    """The last verdict, until when it holds, and the pressure counter when it was reached;
    one per process, read by every thread (a stale verdict only makes a wait spin or nap a
    little longer than it should).  The share of time stalled is taken between two checks,
    not from the kernel's 10-second average, so that a verdict follows the host within a
    second both ways."""

    __slots__ = ("verdict", "until", "_stalled", "_at")

    def __init__(self) -> None:
        self.verdict, self.until = False, 0.0
        self._stalled: int | None = None
        self._at = 0.0

    def configure(self, waits: str) -> None:
        """``Config.waits``: "spin" and "nap" fix the verdict, "auto" measures it."""
        self.verdict, self.until = waits == "nap", math.inf if waits in ("spin", "nap") else 0.0

    def crowded(self) -> bool:
        now = time.monotonic()
        if now >= self.until:
            stalled = _stalled_us()
            if stalled is None:
                self.verdict = _runnable_beyond_cores()
            elif self._stalled is not None:
                share = (stalled - self._stalled) / 1e6 / (now - self._at) * 100
                self.verdict = share > CROWDED_PRESSURE
            self._stalled, self._at, self.until = stalled, now, now + RECHECK_S
        return self.verdict


_CROWDING = _Crowding()
crowded, configure = _CROWDING.crowded, _CROWDING.configure
