"""Starting MPI, describing the host layout, and aborting the job on failure.

This is the one place above the communicators that touches mpi4py directly:
it initialises MPI (or a size-1 singleton when no launcher started us), finds
which ranks share a host with ``MPI_COMM_TYPE_SHARED`` (not launcher-specific
variables, which Open MPI numbers differently under different ``--map-by``),
and installs the hook that turns an uncaught exception into an abort of the
whole job, so that no other rank is left blocked in a collective.
"""
from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from psrt.config import Config

if TYPE_CHECKING:
    from psrt.comm.mpi import MpiCommunicator

# Variables any MPI launcher sets in its ranks; without them we are a singleton.
_LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                       "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")

# A singleton needs no network transport; Open MPI otherwise spends about a
# second probing its OFI component at start-up.
_SINGLETON_MCA_DEFAULTS = {"OMPI_MCA_btl": "^ofi", "OMPI_MCA_mtl": "^ofi"}

#: Line printed on stderr before aborting; ``psrun`` reads it to say which rank failed.
FAILURE_MARKER = "psrt: rank {rank} failed: {how}"


def launched_by_mpi(env: dict[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return any(name in env for name in _LAUNCHER_VARIABLES)


def _import_mpi():
    if not launched_by_mpi():
        for name, value in _SINGLETON_MCA_DEFAULTS.items():
            os.environ.setdefault(name, value)
    from mpi4py import MPI  # initialises MPI (thread level MULTIPLE) on first import

    return MPI


@dataclass(frozen=True)
class Layout:
    """Where this process sits: in the world, on its host, and across hosts."""

    world: MpiCommunicator
    local: MpiCommunicator  # ranks on this host
    cross: MpiCommunicator  # ranks with the same local rank, one per host


def start_mpi(config: Config) -> MpiCommunicator:
    """Initialise MPI if needed; returns the communicator of the whole job."""
    MPI = _import_mpi()
    if not MPI.Is_initialized():
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    from psrt.comm.mpi import MpiCommunicator

    return MpiCommunicator(MPI.COMM_WORLD, config)


def host_layout(world: MpiCommunicator) -> Layout:
    """Split ``world`` into local (same host) and cross (same local rank) groups."""
    local = world.split_by_host()
    cross = world.split(local.rank, key=world.rank)
    assert cross is not None
    return Layout(world=world, local=local, cross=cross)


def describe_exception(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}" + (f": {text[0]}" if text else "")


def install_abort_on_exception(world: MpiCommunicator) -> None:
    """Make an uncaught exception print the traceback, a failure marker, then abort the job.

    Without this, MPI's finalisation on the failing rank blocks while the other
    ranks wait forever in their next collective.
    """
    previous = sys.excepthook

    def abort_on_exception(kind: type[BaseException], exc: BaseException,
                  tb: TracebackType | None) -> None:
        try:
            previous(kind, exc, tb)
        except Exception:  # the user's hook failed: still show the error
            traceback.print_exception(kind, exc, tb)
        if world.size > 1:
            abort_job_with(world, describe_exception(exc))

    sys.excepthook = abort_on_exception


def abort_job_with(world: MpiCommunicator, how: str) -> None:
    """Print the failure marker psrun reports (``psrt: rank R failed: HOW``), then end
    every process of the job."""
    print(FAILURE_MARKER.format(rank=world.rank, how=how), file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    world.abort(1)
