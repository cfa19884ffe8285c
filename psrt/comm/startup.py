"""Watching MPI's own start-up, the one wait on other ranks that comes before any watchdog.

Importing psrt starts MPI (``MPI_Init_thread``, through mpi4py), and MPI's start-up
returns only once every rank of the job has called it: a rank stuck or still busy before
``import psrt.torch`` holds every other rank inside the import, where psrt's watchdog
cannot exist yet (it talks to the other ranks over MPI).  The start-up holds the GIL
too, so no thread of this process can watch it: :class:`StartupWatch` starts a small
watcher *process* (this file, run by the same Python with nothing but its standard
library), which reports at ``PSRT_STALL_CHECK_TIME`` and ends the job at
``PSRT_STALL_SHUTDOWN_TIME``, as the watchdog does any later wait, unless told in time
that MPI has started.  Should the rank die meanwhile, the watcher sees its pipe close
and leaves.

MPI cannot say which rank has not come.  Where every rank of the job runs on this host
and the launcher keeps a directory for the job (Open MPI's, removed with the job), the
ranks leave a mark there as they start MPI, and the report names the ranks that left none.

Nothing here imports psrt: the watcher process runs this file on its own.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time

_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
#: The ranks that report (the others only end the job): one line, not one per rank.
_SPEAKERS = (0, 1)


def _first_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdecimal():
            return int(value)
    return None


def _arrival_directory(rank: int | None, size: int | None) -> str | None:
    """Where the ranks mark their arrival: in the launcher's own directory for the job (Open
    MPI's, which goes with the job), and only when every rank runs on this host."""
    session = os.environ.get("PMIX_SERVER_TMPDIR")
    if not session or rank is None or size is None or _first_int(_LOCAL_SIZE_VARIABLES) != size:
        return None
    return os.path.join(session, "psrt-startup")


class StartupWatch:
    """This rank's side: leaves its mark, starts the watcher, and tells it when MPI has started."""

    def __init__(self, check_s: float, shutdown_s: float) -> None:
        rank, size = _first_int(_RANK_VARIABLES), _first_int(_SIZE_VARIABLES)
        arrivals = _arrival_directory(rank, size)
        try:
            if arrivals is not None:
                os.makedirs(arrivals, exist_ok=True)
                open(os.path.join(arrivals, str(rank)), "w").close()
        except OSError:
            arrivals = None
        args = [str(rank), str(size), f"{check_s!r}", f"{shutdown_s!r}", arrivals or "", str(os.getpid())]
        try:
            self._watcher: subprocess.Popen | None = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, close_fds=True)
        except OSError as e:  # no Python to start (an embedded interpreter): start unwatched
            print(f"psrt: rank {rank}: MPI's start-up is not watched: {e}", file=sys.stderr)
            self._watcher = None

    def stop(self) -> None:
        """MPI has started: the watcher leaves."""
        if self._watcher is None:
            return
        self._watcher.stdin.close()
        try:
            self._watcher.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._watcher.kill()


def _missing(arrivals: str, size: int) -> list[int] | None:
    try:
        arrived = {int(name) for name in os.listdir(arrivals) if name.isdecimal()}
    except OSError:
        return None
    return [r for r in range(size) if r not in arrived]


def _describe(rank: str, size: int, arrivals: str, waited: float, parent: int) -> str:
    missing = _missing(arrivals, size) if arrivals else None
    if missing:
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
               f"{'has' if len(missing) == 1 else 'have'} not started MPI")
    else:
        who = "MPI cannot tell which rank has not started it (not every rank runs on this host)"
    return (f"stall: MPI's start-up (MPI_Init_thread, when psrt is imported) on rank {rank} "
            f"({socket.gethostname()}, pid {parent}) has waited {waited:.0f} s for the other ranks of the job: "
            f"{who}; MPI starts only once every rank has started it, so a rank stuck or still busy before "
            "importing psrt (or one that failed to start) holds every other rank here")


def _started(timeout: float) -> bool:
    """Whether the rank closed the pipe (MPI started, or the rank is gone) within ``timeout``."""
    return bool(select.select([sys.stdin], [], [], max(0.0, timeout))[0])


def main(rank: str, size: str, check: str, shutdown: str, arrivals: str, parent: str) -> None:
    begun, check_s, shutdown_s = time.monotonic(), float(check), float(shutdown)
    if _started(check_s):
        return
    if rank.isdecimal() and int(rank) in _SPEAKERS:
        print(f"psrt: {_describe(rank, int(size), arrivals, time.monotonic() - begun, int(parent))}",
              file=sys.stderr, flush=True)
    if shutdown_s <= 0 or _started(shutdown_s - (time.monotonic() - begun)):
        return
    how = _describe(rank, int(size), arrivals, time.monotonic() - begun, int(parent))
    missing = _missing(arrivals, int(size)) if arrivals else None
    if missing:  # psrun headlines the rank blamed
        print(f"psrt: rank {rank} blames rank {missing[0]}: has not started MPI after {shutdown_s:g} s",
              file=sys.stderr, flush=True)
    print(f"psrt: rank {rank} failed: {how} (PSRT_STALL_SHUTDOWN_TIME={shutdown_s:g} s)", file=sys.stderr,
          flush=True)
    # MPI is not there to abort with: the launcher ends the job once a rank dies.
    os.kill(int(parent), signal.SIGKILL)


if __name__ == "__main__":
    main(*sys.argv[1:])
