"""Starting MPI, finding which ranks share a host, and aborting the job on failure.

This is the one place above the communicators that touches mpi4py directly:
it initialises MPI (or a size-1 singleton when no launcher started us), meets
the other ranks (:class:`Arrivals`: a start-up stall names the ranks that never
came), finds which ranks share a host with ``MPI_COMM_TYPE_SHARED`` (not
launcher-specific variables, which Open MPI numbers differently under different
``--map-by``), and installs the hook that turns an uncaught exception into an
abort of the whole job, so that no other rank is left blocked in a collective.
Failures are always reported with the rank in the job (``MPI_COMM_WORLD``), the
number psrun and mpirun print, also in parameter-server mode.
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from launcher.contract import failure_line
from psrt.config import Config

if TYPE_CHECKING:
    from psrt.comm.mpi import MpiCommunicator

# Variables any MPI launcher sets in its ranks; without them we are a singleton.
_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                       "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")

# A singleton talks to nobody: only the self transport, so that it opens no TCP
# listener, and no OFI, which Open MPI otherwise spends about a second probing.
_SINGLETON_MCA_DEFAULTS = {"OMPI_MCA_btl": "self", "OMPI_MCA_mtl": "^ofi"}


def launched_by_mpi(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return any(name in env for name in _LAUNCHER_VARIABLES)


def start_mpi_at_import() -> None:
    """Start MPI now (importing mpi4py does), before any module of psrt imports it.

    In a process a launcher started, MPI's start-up waits for every rank of the job: it
    runs watched (:class:`psrt.comm.startup.StartupWatch`).  In one no launcher started,
    MPI starts with the singleton's transports (unless the user chose them), taken out of
    the environment again at once, so that programs this process starts (a psrun
    launching a real job) never inherit them.
    """
    if "mpi4py.MPI" in sys.modules:  # the program started MPI itself
        return
    if launched_by_mpi():
        from psrt.comm.startup import StartupWatch

        watch = StartupWatch(*_stall_times())
        try:
            from mpi4py import MPI  # noqa: F401  (initialises MPI, thread level MULTIPLE)
        finally:
            watch.stop()
        return
    saved = {name: os.environ.get(name) for name in _SINGLETON_MCA_DEFAULTS}
    for name, value in _SINGLETON_MCA_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        from mpi4py import MPI  # noqa: F401  (initialises MPI, thread level MULTIPLE)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def watch_finalization() -> None:
    """Have the rest of this process's exit watched, once psrt has shut down at exit: MPI's
    finalisation, which mpi4py runs last, returns only once every rank of the job has called
    it (:func:`psrt.comm.startup.watch_exit`)."""
    if launched_by_mpi() and "mpi4py.MPI" in sys.modules and _job_size() > 1:
        from psrt.comm.startup import watch_exit

        watch_exit(*_stall_times())


def _stall_times() -> tuple[float, float]:
    """The stall check and shutdown times, or their defaults if the settings are wrong
    (``init()`` names what is wrong in them)."""
    from psrt.config import config_from_env
    from psrt.errors import PsrtError

    try:
        config = config_from_env()
    except PsrtError:
        config = Config()
    return config.stall_check_time_s, config.stall_shutdown_time_s


def _import_mpi():
    from mpi4py import MPI  # started already by start_mpi_at_import

    return MPI


@dataclass(frozen=True)
class HostGroups:
    """Where this process sits: in the world, on its host, and across hosts."""

    world: MpiCommunicator
    local: MpiCommunicator  # ranks on this host
    cross: MpiCommunicator  # ranks with the same local rank, one per host


def start_mpi() -> tuple[int, int]:
    """Initialise MPI if needed (nothing collective); returns (rank, size) in the job."""
    MPI = _import_mpi()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def mpi_library() -> str:
    """Which MPI this process loaded, e.g. ``Open MPI v5.0.11`` or ``MPICH Version: 5.0.2``:
    the first line of ``MPI_Get_library_version`` up to its first comma."""
    from psrt.comm.mpi import library_version

    return " ".join(library_version().split(",")[0].split())


def check_thread_level() -> None:
    """psrt's engine and watchdog threads call MPI beside the caller's: anything less than
    MPI_THREAD_MULTIPLE (an MPI built without it, or ``mpi4py.rc.thread_level`` lowered
    before importing mpi4py) would be undefined behaviour, so it is an error."""
    from mpi4py import MPI

    provided = MPI.Query_thread()
    if provided != MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "SINGLE", MPI.THREAD_FUNNELED: "FUNNELED", MPI.THREAD_SERIALIZED: "SERIALIZED"}
        from psrt.errors import CommunicationError

        raise CommunicationError(f"{mpi_library()} provides thread level MPI_THREAD_{names.get(provided, provided)}, "
                                 "but psrt needs MPI_THREAD_MULTIPLE (its engine and watchdog threads call MPI); use "
                                 "an MPI built with thread support and leave mpi4py.rc.thread_level at 'multiple'")


# Where launchers tell their ranks the size of the job: Open MPI's mpirun, and PMI
# (Hydra's mpiexec for MPICH and Intel MPI, srun --mpi=pmi2).
_LAUNCHER_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def check_launcher_agrees(env: Mapping[str, str] | None = None) -> None:
    """A launcher started several ranks, yet MPI here sees a job of one: mpi4py loaded a
    different MPI from the launcher's (mpi4py's wheels load whichever ``libmpi`` they find
    first), and every rank would train alone, as rank 0. That is an error naming both."""
    from mpi4py import MPI

    env = os.environ if env is None else env
    if MPI.COMM_WORLD.Get_size() != 1:
        return
    for name in _LAUNCHER_SIZE_VARIABLES:
        value = env.get(name, "")
        if value.isdigit() and int(value) > 1:
            from psrt.errors import CommunicationError

            launcher = "Open MPI's mpirun" if name.startswith("OMPI_") else "a PMI launcher (MPICH's or Intel MPI's " \
                "mpiexec, or srun)"
            raise CommunicationError(
                f"{launcher} started {value} ranks ({name}={value}), but the MPI this process loaded ({mpi_library()}) "
                "sees a job of one rank: mpi4py loaded another MPI than the launcher's. Launch with psrun (it points "
                "the ranks at its mpirun's own library) or set MPI4PY_LIBMPI to the launcher's libmpi.so")


def job_communicator(config: Config) -> MpiCommunicator:
    """The communicator of the whole job (``MPI_COMM_WORLD``)."""
    from mpi4py import MPI
    from psrt.comm.mpi import MpiCommunicator

    return MpiCommunicator(MPI.COMM_WORLD, config)


# A tag psrt uses on MPI_COMM_WORLD only while init() meets the other ranks.
_ARRIVAL_TAG = 0x7073


class Arrivals:
    """Which ranks have called ``psrt.init()``: rank 0 knows of every rank, the others of
    rank 0.

    Each rank sends rank 0 one byte before its first collective and rank 0 sends each
    rank one, so that while the first collective (which no watchdog can probe yet)
    waits, rank 0 can name the ranks that never came, and rank 1 can say that rank 0
    never came.  :meth:`meet` completes the messages once every rank is there.
    """

    def __init__(self) -> None:
        from mpi4py import MPI

        self._MPI, world = MPI, MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self._byte = bytearray(max(1, self.size - 1))
        self._lock = threading.Lock()  # the watchdog thread tests while init() finishes
        self._sent = bytearray(1)
        if self.rank == 0:  # receives of the others' bytes first, then the sends to them
            others = range(1, self.size)
            self._requests = [world.Irecv([memoryview(self._byte)[r - 1:r], MPI.BYTE], source=r, tag=_ARRIVAL_TAG)
                              for r in others]
            self._requests += [world.Isend([self._sent, MPI.BYTE], dest=r, tag=_ARRIVAL_TAG) for r in others]
        elif self.size > 1:  # the receive of rank 0's byte first, then the send to it
            self._requests = [world.Irecv([memoryview(self._byte)[:1], MPI.BYTE], source=0, tag=_ARRIVAL_TAG),
                              world.Isend([self._sent, MPI.BYTE], dest=0, tag=_ARRIVAL_TAG)]
        else:
            self._requests = []

    def missing(self) -> list[int]:
        """The ranks not yet arrived, as far as this rank can tell (rank 0: any rank; other
        ranks: rank 0 only)."""
        with self._lock:
            if self.rank == 0:
                return [r + 1 for r, request in enumerate(self._requests[:self.size - 1]) if not request.Test()]
            return [0] if self._requests and not self._requests[0].Test() else []

    def speaks(self) -> bool:
        """Whether this rank reports a start-up stall: rank 0, or rank 1 if rank 0 never came."""
        return self.rank == 0 or (self.rank == 1 and self.missing() == [0])

    def describe(self) -> str:
        missing = self.missing()
        if missing:
            from psrt.comm.ranks import rank_ranges

            return (f"psrt.init() on rank {self.rank} waiting for rank{'s' if len(missing) > 1 else ''} "
                    f"{rank_ranges(missing)} to call psrt.init() (failed to start, or stuck before init)")
        return f"psrt.init() on rank {self.rank} waiting for every rank of the job to call psrt.init()"

    def meet(self):
        """Duplicate MPI_COMM_WORLD (collective: returns once every rank called init) for the
        watchdog's own traffic, and complete the arrival messages."""
        comm = self._MPI.COMM_WORLD.Dup()
        with self._lock:
            self._MPI.Request.Waitall(self._requests)
        return comm


def host_groups(world: MpiCommunicator) -> HostGroups:
    """Split ``world`` into local (same host) and cross (same local rank) groups."""
    local = world.split_by_host()
    cross = world.split(local.rank, key=world.rank)
    assert cross is not None
    return HostGroups(world=world, local=local, cross=cross)


def describe_exception(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())  # the marker is one line
    return f"raised {type(exc).__name__}" + (f": {text}" if text else "")


def install_abort_on_exception() -> None:
    """Make an uncaught exception print the traceback, a failure marker, then abort the job
    (once per process: a second call changes nothing).

    Without this, MPI's finalisation on the failing rank blocks while the other
    ranks wait forever in their next collective.
    """
    previous = sys.excepthook
    if getattr(previous, "__module__", "") == __name__:
        return

    def abort_on_exception(kind: type[BaseException], exc: BaseException,
                  tb: TracebackType | None) -> None:
        try:
            previous(kind, exc, tb)
        except Exception:  # the user's hook failed: still show the error
            traceback.print_exception(kind, exc, tb, file=sys.__stderr__)
        if _job_size() > 1:
            if sys.stderr is not sys.__stderr__:
                # A hook installed after this one (torch.distributed's) captures stderr to
                # print it later, which the abort prevents: show the traceback now.
                traceback.print_exception(kind, exc, tb, file=sys.__stderr__)
            abort_job(describe_exception(exc))

    sys.excepthook = abort_on_exception


def _job_size() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def fail_init(exc: BaseException) -> None:
    """``init()`` raised on this rank: in a job of several ranks, end the job naming the
    reason (the other ranks would otherwise wait for this one in init's collectives)."""
    if _job_size() > 1:
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        abort_job(f"psrt.init() {describe_exception(exc)}")


def abort_job(how: str) -> None:
    """Print the failure marker psrun reports (``psrt: rank R failed: HOW``, R the rank in
    the job), then end every process of the job."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    # The process's own stderr: sys.stderr may be a capture that the abort never prints.
    print(failure_line(world.Get_rank(), how), file=sys.__stderr__)
    for stream in (sys.stderr, sys.__stderr__, sys.stdout):
        stream.flush()
    world.Abort(1)
