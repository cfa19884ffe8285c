"""Watching MPI's own start-up and finalisation, the waits on other ranks that come before
psrt's watchdog exists and after it has stopped.

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

The end mirrors the start: mpi4py finalises MPI (``MPI_Finalize``) as the very last step of
the process, after every exit handler, psrt's exit-time ``shutdown()`` and its watchdog
included, and the finalisation too returns only once every rank has called it.  A rank that
shut psrt down and then goes on with its own code (or is stuck in another exit handler)
holds every other rank there.  psrt's exit handler therefore starts a watcher as well
(:func:`watch_exit`), which is never told to leave: it leaves when the rank's process ends.

MPI cannot say which rank has not come.  Where every rank of the job runs on this host
and the launcher keeps a directory for the job (Open MPI's, removed with the job), the
ranks leave a mark there as they start MPI (or reach their exit), and the report names the
ranks that left none.

Nothing here imports psrt: the watcher process runs this file on its own, and loads the lines
psrun reads from :mod:`launcher.contract` by that file's path.
"""
from __future__ import annotations

import importlib.util
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

_RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
#: The ranks that report where no marks tell which ranks wait (the others only end the job),
#: so that one or two lines come, not one per rank; where marks tell, the lowest rank waiting.
_SPEAKERS = (0, 1)
#: How often a watcher looks whether the rank it watches has ended.
_LOOK_EVERY_S = 0.25

START_UP, EXIT = "start-up", "exit"
#: By phase: the marks' directory, the wait, what a missing rank has not done (one, several;
#: the first also where the ranks are not known), what holds the ranks when every one has
#: left its mark, and why a missing rank holds the others.
_PHASES = {
    START_UP: ("psrt-startup", "MPI's start-up (MPI_Init_thread, when psrt is imported)",
               ("has not started MPI", "have not started MPI", "has not started it"),
               "every rank has started it: MPI's own start-up is slow or stuck (its network, its launcher)",
               ("MPI starts only once every rank has started it, so a rank stuck or still busy before "
                "importing psrt (or one that failed to start) holds every other rank here")),
    EXIT: ("psrt-exit", "MPI's finalisation (MPI_Finalize, at the end of the process, after psrt.shutdown())",
           ("has not finished", "have not finished", "has not finished"),
           "every rank has reached psrt's exit: one is still in a later exit handler of its own, or in "
           "MPI_Finalize",
           ("MPI ends only once every rank has finalised it, so a rank still running its own code after "
            "psrt.shutdown() (or stuck at its exit) holds every other rank here")),
}


def _first_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdecimal():
            return int(value)
    return None


def _arrival_directory(rank: int | None, size: int | None, phase: str) -> str | None:
    """Where the ranks mark their arrival: in the launcher's own directory for the job (Open
    MPI's, which goes with the job), and only when every rank runs on this host."""
    session = os.environ.get("PMIX_SERVER_TMPDIR")
    if not session or rank is None or size is None or _first_int(_LOCAL_SIZE_VARIABLES) != size:
        return None
    return os.path.join(session, _PHASES[phase][0])


def _start_watcher(phase: str, check_s: float, shutdown_s: float, stdin: int) -> subprocess.Popen | None:
    """Leave this rank's mark and start the watcher of ``phase``, reading ``stdin`` (it leaves
    once nothing writes there any more, or this process has ended); None where no watcher can
    start."""
    rank, size = _first_int(_RANK_VARIABLES), _first_int(_SIZE_VARIABLES)
    if size == 1:  # nobody to wait for
        return None
    arrivals = _arrival_directory(rank, size, phase)
    try:
        if arrivals is not None:
            os.makedirs(arrivals, exist_ok=True)
            open(os.path.join(arrivals, str(rank)), "w").close()
    except OSError:
        arrivals = None
    args = [str(rank), str(size), f"{check_s!r}", f"{shutdown_s!r}", arrivals or "", str(os.getpid()), phase]
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), *args], stdin=stdin,
                                stdout=subprocess.DEVNULL, close_fds=True)
    except OSError as e:  # no Python to start (an embedded interpreter): go on unwatched
        print(f"psrt: rank {rank}: {_PHASES[phase][1]} is not watched: {e}", file=sys.stderr)
        return None


class StartupWatch:
    """This rank's side at the start: leaves its mark, starts the watcher, and tells it when
    MPI has started."""

    def __init__(self, check_s: float, shutdown_s: float) -> None:
        self._watcher = _start_watcher(START_UP, check_s, shutdown_s, subprocess.PIPE)

    def stop(self) -> None:
        """MPI has started: the watcher leaves, and a thread reaps it once it has (waiting here
        would add its own start-up to every import; never waiting would leave it a zombie
        child of the rank, ``<defunct>``, for the whole job)."""
        if self._watcher is not None:
            self._watcher.stdin.close()
            threading.Thread(target=self._watcher.wait, name="psrt-startup-watcher-reaper", daemon=True).start()


def watch_exit(check_s: float, shutdown_s: float) -> None:
    """This rank's side at the exit, once psrt has shut down: leaves its mark and starts the
    watcher of MPI's finalisation.  The pipe's one writer is a bare descriptor that nothing in
    this process closes: the watcher sees the pipe close, and leaves, when the process ends."""
    read, write = os.pipe()
    try:
        if _start_watcher(EXIT, check_s, shutdown_s, read) is None:
            os.close(write)
    finally:
        os.close(read)


def _missing(arrivals: str, size: int) -> list[int] | None:
    try:
        arrived = {int(name) for name in os.listdir(arrivals) if name.isdecimal()}
    except OSError:
        return None
    return [r for r in range(size) if r not in arrived]


def _describe(phase: str, rank: str, size: int, arrivals: str, waited: float, parent: int) -> str:
    _, wait, (one, several, unknown), everyone, why = _PHASES[phase]
    missing = _missing(arrivals, size) if arrivals else None
    if missing:
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} "
               f"{one if len(missing) == 1 else several}")
    elif missing == []:
        who = everyone
    else:
        who = f"MPI cannot tell which rank {unknown} (not every rank runs on this host)"
    return (f"stall: {wait} on rank {rank} ({socket.gethostname()}, pid {parent}) has waited {waited:.0f} s "
            f"for the other ranks of the job: {who}; {why}")


def _speaks(rank: str, size: int, arrivals: str) -> bool:
    """Whether this rank reports: the lowest rank that waits, where the marks tell; else one of
    :data:`_SPEAKERS`."""
    if not rank.isdecimal():
        return False
    missing = _missing(arrivals, size) if arrivals else None
    if missing is not None:
        return int(rank) == min(set(range(size)) - set(missing), default=int(rank))
    return int(rank) in _SPEAKERS


def _identity(pid: int) -> str | None:
    """What tells process ``pid`` from a later one given its id (its start time, where Linux's
    /proc says), or None once it has ended."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state, *fields = f.read().rsplit(b")", 1)[1].split()
        return None if state in (b"Z", b"X") else fields[18].decode()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: whether some process has that id
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        return ""


def _released(timeout: float, pid: int, identity: str | None) -> bool:
    """Whether, within ``timeout``, the rank closed the pipe (MPI started) or ended (even if a
    process it forked still holds the pipe)."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        left = deadline - time.monotonic()
        if select.select([sys.stdin], [], [], max(0.0, min(left, _LOOK_EVERY_S)))[0] or _identity(pid) != identity:
            return True
        if left <= _LOOK_EVERY_S:
            return False


def _launch_contract():
    """:mod:`launcher.contract`, loaded from its file beside psrt's package (both come from one
    distribution): the watcher runs with the standard library alone, and the contract imports
    nothing else."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("psrt_launch_contract", os.path.join(root, "launcher", "contract.py"))
    contract = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(contract)
    return contract


def main(rank: str, size: str, check: str, shutdown: str, arrivals: str, parent: str, phase: str = START_UP) -> None:
    begun, check_s, shutdown_s, pid = time.monotonic(), float(check), float(shutdown), int(parent)
    contract = _launch_contract()
    ranks = int(size) if size.isdecimal() else 0  # 0: not known (then neither are the marks)
    identity = _identity(pid)
    if identity is None or _released(check_s, pid, identity):
        return
    if _speaks(rank, ranks, arrivals):
        print(f"psrt: {_describe(phase, rank, ranks, arrivals, time.monotonic() - begun, pid)}",
              file=sys.stderr, flush=True)
    if shutdown_s <= 0 or _released(shutdown_s - (time.monotonic() - begun), pid, identity):
        return
    how = _describe(phase, rank, ranks, arrivals, time.monotonic() - begun, pid)
    missing = _missing(arrivals, ranks) if arrivals else None
    if missing:  # psrun headlines the rank blamed
        why = f"{_PHASES[phase][2][0]} after {shutdown_s:g} s"
        print(contract.blame_line(rank, contract.rank_name(missing[0]), why), file=sys.stderr, flush=True)
    print(contract.failure_line(rank, f"{how} (PSRT_STALL_SHUTDOWN_TIME={shutdown_s:g} s)"), file=sys.stderr,
          flush=True)
    # MPI is not there to abort with: the launcher ends the job once a rank dies.
    os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(*sys.argv[1:])
