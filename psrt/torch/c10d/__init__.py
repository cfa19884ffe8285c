"""psrt as a ``torch.distributed`` backend: ``dist.init_process_group("psrt")``.

Importing ``psrt.torch`` registers the backend for CPU and CUDA tensors and puts psrt's
``env://`` start-up in front of torch's (:mod:`psrt.torch.c10d.rendezvous`), so that code
written against ``torch.distributed`` runs under ``mpirun`` or ``psrun`` with one changed
argument.  Each torch group gets a direct group of its own over the same members
(:mod:`psrt.torch.c10d.group`); :func:`process_group` makes one over a psrt process set.
"""
from __future__ import annotations

import torch.distributed as dist

import psrt.runtime
from psrt.errors import InvalidArgumentError
from psrt.topology import ProcessSet
from psrt.torch.c10d import rendezvous
from psrt.torch.c10d.group import PsrtProcessGroup

BACKEND = "psrt"


def _create(options: object, backend_options: object) -> PsrtProcessGroup:
    """torch's backend creator: a group of ``options.global_ranks_in_group`` (empty for the
    default group: every rank), called on its members only."""
    psrt.runtime.init()
    runtime = psrt.runtime.current()
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    me = psrt.runtime.rank()
    if options.group_size != len(ranks) or ranks[options.group_rank] != me:
        raise InvalidArgumentError(
            f"torch.distributed places this process at rank {ranks[options.group_rank]} of {len(ranks)} but MPI at "
            f"rank {me} of {psrt.runtime.size()}: start torch's default group with backend 'psrt' or under "
            "mpirun with MPI's ranks")
    if not options.global_ranks_in_group and options.group_size != psrt.runtime.size():
        raise InvalidArgumentError(f"torch.distributed's world has {options.group_size} ranks but MPI's has "
                                   f"{psrt.runtime.size()}")
    name = f"torch.distributed group {options.group_id} of ranks {ranks}"
    topology = runtime.topology
    return PsrtProcessGroup(topology.direct_over(ranks, key=str(options.group_id), name=name), topology.release)


def process_group(process_set: ProcessSet | None = None) -> dist.ProcessGroup:
    """A ``torch.distributed`` process group over ``process_set``'s ranks on psrt's backend,
    for DDP, FSDP2, DTensor or a ``DeviceMesh`` beside psrt's own API in one job.  Starts
    torch's default group with backend ``"psrt"`` first where none is running.

    Collective: every rank of the world calls it, in the same order, with the same set (a
    rank outside the set too), as ``torch.distributed.new_group``.

    :param process_set: a :class:`~psrt.ProcessSet` (registered or not); default None: every
        rank, which is torch's default group when that runs on psrt.
    :returns: the group, or ``torch.distributed.GroupMember.NON_GROUP_MEMBER`` on a rank
        outside the set.
    """
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise InvalidArgumentError(f"process_set must be a psrt ProcessSet, got {type(process_set).__name__}")
    if not dist.is_initialized():
        dist.init_process_group(BACKEND)
    ranks = None if process_set is None else process_set.ranks
    if ranks is None and dist.get_backend() == BACKEND:
        return dist.group.WORLD
    return dist.new_group(ranks=ranks, backend=BACKEND)


def register() -> None:
    """Make ``"psrt"`` a torch backend and install the MPI start-up (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    rendezvous.install()
