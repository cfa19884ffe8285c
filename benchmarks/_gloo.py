"""The gloo baseline's set-up, shared by the benchmarks: torch.distributed over gloo in
the ranks an MPI launcher started."""
from __future__ import annotations

import socket

import torch.distributed as dist


def init_gloo(comm) -> None:
    """torch.distributed with gloo: TCP rendezvous on 127.0.0.1, rank and size from the
    mpi4py communicator ``comm`` (rank 0 picks a free port and tells the others)."""
    port = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=comm.rank, world_size=comm.size)
