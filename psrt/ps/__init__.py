"""Parameter-server mode: server ranks hold sharded parameters and run the optimizer,
worker ranks push gradients and pull parameters.

Launch with ``psrun --num-servers S -np N ...`` (or ``PSRT_NUM_SERVERS=S``):
on a server rank ``psrt.init()`` serves until every worker has shut down and
then exits the process; on worker ranks it returns, and ``psrt.rank()``,
``size()`` and every collective cover the workers only.  Workers then use a
:class:`KVStore` directly or train a model through :func:`DistributedOptimizer`.
"""
from __future__ import annotations

from psrt import runtime
from psrt.errors import ParameterServerError
from psrt.ps.client import KVStore
from psrt.ps.handles import Handle
from psrt.ps.optimizer import DistributedOptimizer
from psrt.ps.service import split_job

# psrt.init() splits the job into servers and workers whenever PSRT_NUM_SERVERS is set.
runtime.register_role_split("num_servers", split_job)

__all__ = ["DistributedOptimizer", "Handle", "KVStore", "ParameterServerError", "num_servers", "num_workers",
           "role", "serve", "worker_rank"]


def role() -> str:
    """"worker" on every rank that runs user code after ``init()`` (server ranks serve
    inside ``init()`` and never return to it)."""
    runtime.current()
    return "worker"


def num_servers() -> int:
    """How many ranks of the job are servers (0 outside parameter-server mode)."""
    ps = runtime.current().ps
    return 0 if ps is None else ps.num_servers


def num_workers() -> int:
    """How many ranks are workers (all ranks outside parameter-server mode)."""
    return runtime.size()


def worker_rank() -> int:
    """This worker's index among the workers (its ``psrt.rank()``)."""
    return runtime.rank()


def serve() -> None:
    """Start psrt; on a server rank this serves until the workers are done, then exits.
    Equivalent to ``psrt.init()``, for scripts that want to say so.

    Collective: every rank of the job calls it (or ``psrt.init()``), in the same order.
    """
    runtime.init()
