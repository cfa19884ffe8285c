"""Each rank's place in the job, in the variables other launchers give their processes.

torchrun starts every process with its place in the job in its environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, and the node's ``GROUP_RANK`` and
``GROUP_WORLD_SIZE``), and torch's tools read them: accelerate decides from ``LOCAL_RANK``
whether a job is distributed and which GPU is the process's, the Hugging Face ``Trainer``
goes by accelerate, and many scripts pick their device with ``LOCAL_RANK``.  horovodrun gives
its workers ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``,
``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE`` and ``HOROVOD_HOSTNAME``, and code written for
Horovod reads them.  No MPI launcher sets either, so psrt does, at three moments:

- psrun starts every rank through a wrapper that exports torchrun's first four from Open MPI's
  or Hydra's variables (:mod:`launcher.rank_stderr`), before the program starts;
- ``import psrt.torch`` does the same under any MPI launcher (plain ``mpirun``, ``mpiexec``,
  and ``srun``, whose ``SLURM_PROCID``, ``SLURM_LOCALID`` and ``SLURM_NTASKS`` come last), from
  the same table, without calling MPI (:func:`fill_from_launcher`);
- ``init()`` sets the ``HOROVOD_*`` variables from the runtime's world, local and cross groups,
  replacing any inherited (mpirun decides which process gets which rank only as it starts
  them, so psrun cannot write one value right for every rank), and sets torchrun's that are
  still missing from the same groups, the node ones included (:func:`export_rank_variables`).

A torchrun variable a process already has is never replaced, and torchrun's are set only in a
job an MPI launcher started: a process started alone keeps torch's and accelerate's
single-process behaviour.  In parameter-server mode the ranks that train are the workers, and
the variables describe them alone, as ``dist.get_rank()`` and ``hvd.rank()`` do: ``RANK`` is a
worker's index among the workers, ``WORLD_SIZE`` their number, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE`` count the workers on its host.  Which ranks serve is decided in
``init()``, so in that mode only ``init()`` sets them.  Whatever is set holds from then on, in
this process and every process it starts afterwards (data loader workers, tools).
"""
from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping

from launcher.contract import ENV_NUM_SERVERS, TORCH_RANK_VARIABLES
from psrt.comm.bootstrap import launched_by_mpi
from psrt.topology import Topology

__all__ = ["export_rank_variables", "fill_from_launcher", "horovod_variables", "launcher_variables",
           "torch_variables"]

# srun's names, for the ranks it starts itself (``srun --mpi=pmix`` sets neither Open MPI's nor
# Hydra's): after the MPI launchers', which set all of theirs, so that a rank that mpirun
# started inside a SLURM allocation never takes the batch script's (rank 0's) from the
# environment it inherited.
_SLURM = {"RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID", "WORLD_SIZE": "SLURM_NTASKS"}


def launcher_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The torchrun variables ``env`` lacks that its MPI launcher holds: none outside a job an
    MPI launcher started, or in parameter-server mode."""
    if not launched_by_mpi(env) or (env.get(ENV_NUM_SERVERS) or "0") != "0":
        return {}
    found = {}
    for name, sources in TORCH_RANK_VARIABLES:
        value = next((env[source] for source in (*sources, _SLURM.get(name, "")) if env.get(source)), None)
        if value is not None and not env.get(name):
            found[name] = value
    return found


def fill_from_launcher(env: MutableMapping[str, str] | None = None) -> None:
    """Set, in ``env`` (default ``os.environ``), the torchrun variables it lacks that its MPI
    launcher holds (:func:`launcher_variables`); what ``import psrt.torch`` runs."""
    env = os.environ if env is None else env
    env.update(launcher_variables(env))


def horovod_variables(topology: Topology, hostname: str) -> dict[str, str]:
    """This rank's ``HOROVOD_*`` variables: world, local (this host) and cross (the ranks
    with this local rank, one per host) rank and size, as Horovod defines them."""
    return {
        "HOROVOD_RANK": str(topology.world.rank), "HOROVOD_SIZE": str(topology.world.size),
        "HOROVOD_LOCAL_RANK": str(topology.local.rank), "HOROVOD_LOCAL_SIZE": str(topology.local.size),
        "HOROVOD_CROSS_RANK": str(topology.cross.rank), "HOROVOD_CROSS_SIZE": str(topology.cross.size),
        "HOROVOD_HOSTNAME": hostname,
    }


def torch_variables(topology: Topology, host: int, hosts: int) -> dict[str, str]:
    """This rank's torchrun variables as the runtime's groups say them: rank and size in the
    world, on this host, and the host's index among the ``hosts`` hosts (``host``)."""
    return {
        "RANK": str(topology.world.rank), "WORLD_SIZE": str(topology.world.size),
        "LOCAL_RANK": str(topology.local.rank), "LOCAL_WORLD_SIZE": str(topology.local.size),
        "GROUP_RANK": str(host), "GROUP_WORLD_SIZE": str(hosts),
    }


def export_rank_variables(topology: Topology, env: MutableMapping[str, str] | None = None) -> None:
    """Set this rank's ``HOROVOD_*`` variables in ``env`` (default ``os.environ``), replacing any
    inherited, and, in a job an MPI launcher started, the torchrun variables it still lacks.

    Collective: every rank of the world calls it, in the same order (``init()`` does).
    """
    env = os.environ if env is None else env
    env.update(horovod_variables(topology, socket.gethostname()))
    if launched_by_mpi(env):
        known = torch_variables(topology, *topology.host_place())
        env.update({name: value for name, value in known.items() if not env.get(name)})
