"""Which ranks of the job are parameter servers and which are workers: a plain value.

Servers are spread across hosts (one per host in turn, taking each host's
highest local ranks), so their network bandwidth adds up instead of sitting
behind one host's link, and worker ranks keep the low numbers, so worker 0 is
job rank 0 wherever possible.  Computed identically on every rank from the
host of each rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from launcher.contract import rank_name
from psrt.errors import InvalidArgumentError


@dataclass(frozen=True)
class Roles:
    """Job ranks of the servers and of the workers, each in order of their index."""

    servers: tuple[int, ...]
    workers: tuple[int, ...]

    def is_server(self, job_rank: int) -> bool:
        return job_rank in self.servers

    def worker_index(self, job_rank: int) -> int:
        """The worker number of ``job_rank`` (its rank among the workers)."""
        return self.workers.index(job_rank)

    def server_index(self, job_rank: int) -> int:
        return self.servers.index(job_rank)

    def describe_rank(self, job_rank: int) -> str:
        """``rank 2 (parameter server 0)``, ``rank 1 (worker 1)``: how reports name a rank."""
        if job_rank in self.servers:
            return rank_name(job_rank, f"parameter server {self.server_index(job_rank)}")
        return rank_name(job_rank, f"worker {self.worker_index(job_rank)}")


def assign_roles(hosts: Sequence[object], num_servers: int) -> Roles:
    """Pick ``num_servers`` server ranks from a job whose rank ``r`` runs on ``hosts[r]``."""
    size = len(hosts)
    if not 0 < num_servers < size:
        raise InvalidArgumentError(
            f"{num_servers} parameter servers in a job of {size} ranks: there must be at least "
            f"one server and one worker (set PSRT_NUM_SERVERS / psrun --num-servers below {size})")
    ranks_by_host: dict[object, list[int]] = {}
    for rank, host in enumerate(hosts):
        ranks_by_host.setdefault(host, []).append(rank)
    queues = [ranks for ranks in ranks_by_host.values()]  # hosts in order of their first rank
    servers: list[int] = []
    turn = 0
    while len(servers) < num_servers:
        queue = queues[turn % len(queues)]
        if queue:
            servers.append(queue.pop())  # the host's highest remaining rank
        turn += 1
    chosen = set(servers)
    return Roles(servers=tuple(sorted(chosen)),
                 workers=tuple(r for r in range(size) if r not in chosen))
