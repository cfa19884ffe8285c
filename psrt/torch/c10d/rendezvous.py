"""torch's ``env://`` start-up under ``mpirun``: rank and size from MPI, the store's address
from rank 0.

``init_process_group`` meets the other ranks through a store before it makes any backend,
and by default through ``env://``, which needs ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``.  ``mpirun`` sets none of them (psrun's ranks and ``import psrt.torch`` set
the first two, :mod:`psrt.rank_env`).  psrt wraps torch's ``env://`` handler: in a process an
MPI launcher started (or where psrt is running), psrt starts, the rank and size are MPI's
(a rank or size given otherwise is refused), and rank 0 opens the store, on
``MASTER_ADDR``/``MASTER_PORT`` where set (Lightning sets them), else on a port the system
picks, and tells the others over MPI.  Elsewhere (torchrun, a user's own start-up), torch's
handler runs unchanged.  Any backend benefits: gloo too.

torch's own store listens on every address of the host, so anything that reaches the node
could read and write the job's keys.  psrt's listens only where the ranks connect: loopback
when the job is on one host, else ``MASTER_ADDR`` or the address of rank 0's host name
(every address where that name resolves to none but loopback).  And every key lives under a
random per-job prefix that rank 0 hands the others over MPI, so a process that does connect
to the port (any local user, on one host) finds none of them and can write none the job
reads (docs/guides/cluster.md#trust-model).
"""
from __future__ import annotations

import importlib
import ipaddress
import os
import secrets
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
        if not (bootstrap.launched_by_mpi() or psrt.runtime.is_initialized()):
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


def _store(rank: int, size: int, timeout: timedelta) -> dist.Store:
    """A TCP store served by rank 0 on ``MASTER_ADDR``/``MASTER_PORT`` where set, else on
    loopback (one host) or its host name's address, on a port the system picks; the job's
    keys under a secret prefix."""
    from psrt.torch.functions import broadcast_object  # the torch API sits above this binding's start-up

    where = None
    if rank == 0:
        bind, host = _address(one_host=psrt.runtime.local_size() == size)
        listener = _listen(bind, int(os.environ.get("MASTER_PORT") or 0))
        port = listener.getsockname()[1]
        # the store owns the socket from here on (closes it when it ends)
        store = dist.TCPStore(host, port, size, True, timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach(), use_libuv=True)
        where = (host, port, secrets.token_hex(16))
    host, port, secret = broadcast_object(where, root_rank=0, name="psrt.torch.c10d.store")
    if rank != 0:
        store = dist.TCPStore(host, port, size, False, timeout)
    return dist.PrefixStore(f"psrt-{secret}/", store)


def _address(one_host: bool) -> tuple[str, str]:
    """Where rank 0's store listens, and the name the other ranks connect to.  A host name
    that resolves to no address, or to a loopback one (Debian's ``127.0.1.1``), leaves every
    address: the secret prefix still guards the keys."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"], os.environ["MASTER_ADDR"]
    if one_host:
        return "127.0.0.1", "127.0.0.1"
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return "", name
    return ("", name) if ipaddress.ip_address(address).is_loopback else (address, address)


def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` alone ("": every address; port 0: one the system picks)."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                flags=socket.AI_PASSIVE)[0]
    except OSError as e:
        raise InvalidArgumentError(f"rank 0 cannot serve torch.distributed's store on {host}:{port}: {e} "
                                   "(check MASTER_ADDR)") from None
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError as e:
        listener.close()
        raise InvalidArgumentError(f"rank 0 cannot serve torch.distributed's store on {host}:{port}: {e} "
                                   "(check MASTER_ADDR and MASTER_PORT)") from None
    return listener
