"""Whether a rank shares its cores: MPI told to give the core away while it waits, and
psrt's own waits told when not to spin.

A waiting rank that spins keeps its core.  On a host with a core to spare per rank that
is the fastest way to wait; on a crowded one (data-loader workers, a tokenizer, a second
job, more ranks than cores) it takes the core the rank it waits for, or the other work,
needs: the step slows to the scheduler's time slices.  gloo waits in the kernel and loses
nothing there.  So:

* MPI's own waits (a blocking allreduce spins in the MPI library's progress loop) are
  told at start-up to give the core back when a poll finds nothing: Open MPI's
  ``mpi_yield_when_idle`` (``sched_yield``), MPICH's progress throttle (``usleep(1)``
  after polls that found nothing), Intel MPI's wait mode.  These settings are read once,
  when MPI starts, before any data-loader worker exists, so they cannot wait for
  crowding to show: they are set on any host where the ranks have no core to spare
  (:func:`mpi_should_yield`), unless the user chose them.  Where a rank has cores to
  itself, polling stays as it was: on an idle host a yield costs a system call per empty
  poll.
* psrt's own waits (:mod:`psrt.comm.poll`) spin briefly before they nap.  The spin pays
  on an idle host (a reply microseconds away), and only costs on a crowded one, so it
  is skipped while the host is crowded (:func:`crowded`): Linux's CPU pressure (the share
  of time some runnable task waited for a core, over the last 10 s) above
  :data:`CROWDED_PRESSURE`, read at most every :data:`RECHECK_S`.  Where the kernel keeps
  no pressure figures, runnable tasks are counted against the cores instead.

``PSRT_WAITS`` (``Config.waits``) overrides both: ``spin`` never takes the crowded ways,
``nap`` always does.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, MutableMapping

__all__ = ["CROWDED_PRESSURE", "RECHECK_S", "YIELD_SETTINGS", "configure", "crowded", "local_ranks",
           "mpi_should_yield", "set_mpi_yield", "usable_cores"]

#: Percent of the last 10 s in which some runnable task waited for a core, above which
#: the host counts as crowded.
CROWDED_PRESSURE = 10.0
RECHECK_S = 0.5
#: Each MPI's environment variable for waiting that gives the core away, read at MPI_Init.
YIELD_SETTINGS = {
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    "I_MPI_WAIT_MODE": "1",
}
# How each launcher tells a rank how many ranks share its host.
_LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
_PRESSURE = "/proc/pressure/cpu"
_LOADAVG = "/proc/loadavg"


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_ranks(env: Mapping[str, str]) -> int | None:
    """How many ranks of this job share this host, as the launcher says; None if it does not."""
    for name in _LOCAL_SIZE_VARIABLES:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def mpi_should_yield(ranks_here: int | None, cores: int) -> bool:
    """Whether MPI's waits should give the core away: when this host's ranks leave no core to
    spare (any other work then crowds them), or when the launcher does not say how many
    share it."""
    return ranks_here is None or ranks_here >= cores


def set_mpi_yield(env: MutableMapping[str, str], waits: str = "auto") -> list[str]:
    """Put each MPI's yielding setting in ``env`` where ``waits`` (``Config.waits``) or, on
    "auto", this host needs it, and the user left every one of them unset (a user who set
    one has chosen); returns the names set."""
    if waits == "spin" or any(name in env for name in YIELD_SETTINGS):
        return []
    if waits == "auto" and not mpi_should_yield(local_ranks(env), usable_cores()):
        return []
    env.update(YIELD_SETTINGS)
    return list(YIELD_SETTINGS)


def _pressure() -> float | None:
    """``some avg10`` of Linux's CPU pressure, or None where the kernel keeps none."""
    try:
        with open(_PRESSURE) as f:
            first = f.readline().split()
    except OSError:
        return None
    return float(first[1].partition("=")[2]) if len(first) > 1 and first[0] == "some" else None


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
    """The last verdict and when it was reached; one per process, read by every thread (a
    stale verdict only makes a wait spin or nap a little longer than it should)."""

    __slots__ = ("verdict", "until")

    def __init__(self) -> None:
        self.verdict, self.until = False, 0.0

    def configure(self, waits: str) -> None:
        """``Config.waits``: "spin" and "nap" fix the verdict, "auto" measures it."""
        self.verdict, self.until = waits == "nap", math.inf if waits in ("spin", "nap") else 0.0

    def crowded(self) -> bool:
        now = time.monotonic()
        if now >= self.until:
            pressure = _pressure()
            self.verdict = _runnable_beyond_cores() if pressure is None else pressure > CROWDED_PRESSURE
            self.until = now + RECHECK_S
        return self.verdict


_CROWDING = _Crowding()
crowded, configure = _CROWDING.crowded, _CROWDING.configure
