"""torch's ``env://`` start-up under ``mpirun``: rank and size from MPI, the store's address
from rank 0.

``init_process_group`` meets the other ranks through a store before it makes any backend,
and by default through ``env://``, which needs ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``.  ``mpirun`` sets none of them.  psrt wraps torch's ``env://`` handler: where
a variable is missing in a process an MPI launcher started (or where psrt is running),
psrt starts, the rank and size are MPI's, and rank 0 opens the store on a port the system
picks and tells the others over MPI.  Where every variable is set (torchrun, Lightning,
a user's own), torch's handler runs unchanged.  Any backend benefits: gloo too.
"""
from __future__ import annotations

import importlib
import os
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

import torch.distributed as dist

import psrt.runtime
from psrt.comm import bootstrap
from psrt.errors import InvalidArgumentError

_Handler = Callable[..., Iterator[tuple[dist.Store, int, int]]]


def install() -> None:
    """Put psrt's ``env://`` handler in front of torch's (once)."""
    # the module: torch.distributed.rendezvous, as an attribute, is its function of that name
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if not getattr(handlers.get("env"), "psrt_wrapped", False):
        handlers["env"] = _from_mpi(handlers["env"])


def _from_mpi(torch_env: _Handler) -> _Handler:
    def env(url: str, timeout: timedelta = dist.default_pg_timeout, **kwargs: object):
        query = parse_qs(urlparse(url).query)
        wanted = {"RANK": "rank", "WORLD_SIZE": "world_size", "MASTER_ADDR": None, "MASTER_PORT": None}
        missing = [name for name, key in wanted.items() if not os.environ.get(name) and key not in query]
        if not missing or not (bootstrap.launched_by_mpi() or psrt.runtime.is_initialized()):
            yield from torch_env(url, timeout=timeout, **kwargs)
            return
        psrt.runtime.init()
        rank, size = psrt.runtime.rank(), psrt.runtime.size()
        for key, variable, mine in (("rank", "RANK", rank), ("world_size", "WORLD_SIZE", size)):
            given = query[key][0] if key in query else os.environ.get(variable)
            if given and int(given) != mine:
                where = f"{key}={given}" if key in query else f"{variable}={given} in the environment"
                raise InvalidArgumentError(f"init_process_group was given {where} but MPI says {mine} on this "
                                           f"process (under mpirun, leave {key} out)")
        yield _store(rank, size, timeout), rank, size
        raise RuntimeError("env:// rendezvous under MPI cannot run again in one process group")

    env.psrt_wrapped = True
    return env


def _store(rank: int, size: int, timeout: timedelta) -> dist.TCPStore:
    """A TCP store served by rank 0 on ``MASTER_ADDR``/``MASTER_PORT`` where set, else on
    loopback (one host) or its host name, on a port the system picks."""
    from psrt.torch.functions import broadcast_object  # the torch API sits above this binding's start-up

    address = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if psrt.runtime.local_size() == size else socket.gethostname())
        store = dist.TCPStore(host, int(os.environ.get("MASTER_PORT") or 0), size, True, timeout,
                              wait_for_workers=False)
        address = (host, store.port)
    address = broadcast_object(address, root_rank=0, name="psrt.torch.c10d.store")
    if rank == 0:
        return store
    return dist.TCPStore(address[0], address[1], size, False, timeout)
