"""The ``HOROVOD_*`` variables Horovod's launcher gives each worker, filled in from MPI.

horovodrun's elastic launcher starts every worker with its place in the job in its
environment (``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``,
``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE``, ``HOROVOD_HOSTNAME``), and code written for
Horovod reads them.  Under psrun, mpirun decides which process gets which rank only as it
starts them, so psrun cannot write one value that is right for every rank; ``init()``
sets them instead, from the runtime's own world, local and cross groups.  They hold from
``hvd.init()`` on, in this process and every process it starts afterwards (data loader
workers, tools).
"""
from __future__ import annotations

import os
import socket

from psrt.topology import Topology

__all__ = ["export_horovod_variables", "horovod_variables"]


def horovod_variables(topology: Topology, hostname: str) -> dict[str, str]:
    """This rank's ``HOROVOD_*`` variables: world, local (this host) and cross (the ranks
    with this local rank, one per host) rank and size, as Horovod defines them."""
    return {
        "HOROVOD_RANK": str(topology.world.rank), "HOROVOD_SIZE": str(topology.world.size),
        "HOROVOD_LOCAL_RANK": str(topology.local.rank), "HOROVOD_LOCAL_SIZE": str(topology.local.size),
        "HOROVOD_CROSS_RANK": str(topology.cross.rank), "HOROVOD_CROSS_SIZE": str(topology.cross.size),
        "HOROVOD_HOSTNAME": hostname,
    }


def export_horovod_variables(topology: Topology) -> None:
    """Set this rank's ``HOROVOD_*`` variables in ``os.environ`` (replacing any inherited)."""
    os.environ.update(horovod_variables(topology, socket.gethostname()))
