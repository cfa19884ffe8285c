"""Parameter-server mode at start-up and shut-down: how the job splits into servers and
workers, what a server rank runs, and the worker's link to the servers that every KVStore
of that worker shares.

``psrt.init()`` calls :func:`split_job` (which :mod:`psrt.ps` registers with the
runtime) when ``PSRT_NUM_SERVERS`` is set: a server rank then serves (until every worker
has shut down) and a worker keeps a :class:`WorkerLink`; the
link's :meth:`~WorkerLink.close` (run by ``psrt.shutdown()``) finishes every
store's outstanding requests, completes the push receives the servers hold for this
worker, and tells each server this worker is gone.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Protocol

import torch

from psrt.comm import bootstrap
from psrt.comm.base import Communicator
from psrt.comm.direct import DirectGroup
from psrt.comm.mpi import MpiCommunicator
from psrt.comm.watchdog import Watchdog
from psrt.config import Config
from psrt.ps import protocol
from psrt.ps.protocol import RequestKind
from psrt.ps.roles import Roles, assign_roles
from psrt.ps.server import Server


class _Closable(Protocol):
    def close(self) -> None: ...


def split_job(job: MpiCommunicator, config: Config, watchdog: Watchdog
              ) -> tuple[MpiCommunicator | None, WorkerLink | None, Callable[[], None] | None]:
    """Split the job into servers and workers: (the workers' world, this worker's link to
    the servers, None) on a worker, (None, None, the function that serves) on a server.
    Collective over the job, inside ``psrt.init()``."""
    local = job.split_by_host()
    host_leader = local.allgather_object(job.rank)[0]
    local.free()
    assigned = assign_roles(job.allgather_object(host_leader), config.num_servers)
    watchdog.name_ranks(assigned.describe_rank, world_to_job=assigned.workers)
    server = assigned.is_server(job.rank)
    link_comm = job.split(0, key=job.rank)  # worker <-> server traffic, apart from collectives
    workers = job.split(None if server else 0, key=job.rank)
    assert link_comm is not None
    if server:
        def serve() -> None:
            run_server(link_comm, assigned, config, watchdog, bootstrap.abort_job)
            link_comm.free()
        return None, None, serve
    assert workers is not None
    return workers, WorkerLink(link_comm, assigned, config, watchdog), None


def run_server(comm: Communicator, roles: Roles, config: Config, watchdog: Watchdog,
               abort: Callable[[str], None]) -> None:
    """Serve the workers until all of them have shut down."""
    Server(comm, roles, config, watchdog, abort).serve()


class WorkerLink:
    """A worker's channel to the servers: a direct group over the job-wide communicator
    (its waits marked on ``watchdog``, naming servers by job rank), the role table, the
    request tags and the push tags the servers gave, shared by this worker's stores."""

    def __init__(self, comm: Communicator, roles: Roles, config: Config, watchdog: Watchdog) -> None:
        self.comm, self.roles, self.config = comm, roles, config
        self.group = DirectGroup(comm, range(comm.size), watchdog, key="the parameter-server link",
                                 name="the parameter-server link", job_ranks=True)
        self.worker = roles.worker_index(comm.rank)
        self.num_workers = len(roles.workers)
        self.num_servers = len(roles.servers)
        self.lock = threading.RLock()  # hooks may push from autograd's threads
        self._requests = itertools.count()
        self._store_ids = itertools.count()
        self._stores: list[_Closable] = []
        self._push_tags: list[tuple[int, int]] = []  # (server rank, tag) with a receive posted for us
        self.closed = False

    def next_tag(self) -> int:
        return protocol.request_tag(next(self._requests), self.comm.max_tag)

    def server_rank(self, server: int) -> int:
        return self.roles.servers[server]

    def push_tag(self, server: int, tag: int) -> int:
        """Note that ``server`` holds a receive for this worker's pushes on ``tag``."""
        self._push_tags.append((self.server_rank(server), tag))
        return tag

    def register_store(self, store: _Closable) -> int:
        """A new store's id (the same on every worker that creates stores in the same order)."""
        self._stores.append(store)
        return next(self._store_ids)

    def release(self) -> None:
        """Free the link's communicator (after :meth:`close`, once the runtime's topology
        is freed)."""
        self.comm.free()

    def close(self) -> None:
        """Finish every store's requests, send an empty message on every push tag (which
        completes the receive its server holds for this worker's next push), then tell every
        server this worker is gone."""
        if self.closed:
            return
        self.closed = True
        for store in self._stores:
            store.close()
        empty = torch.empty(0, dtype=torch.uint8)
        with self.lock:
            requests = [self.comm.isend(empty, rank, tag) for rank, tag in self._push_tags]
            bye = protocol.request(RequestKind.BYE).encode()
            requests += [self.comm.isend(bye, self.server_rank(server), protocol.HEADER_TAG)
                         for server in range(self.num_servers)]
            for request in requests:
                self.group.wait(request, "a parameter-server request",
                                f"worker {self.worker}'s goodbye to the parameter servers", self.roles.servers)
