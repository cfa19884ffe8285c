"""Transport layer: the :class:`Communicator` interface and its MPI and NCCL backends.

Nothing above this package imports mpi4py or cupy.  Importing mpi4py starts MPI, so a
process that no launcher started gets its transport settings here, before any module
of this package imports it (see :func:`psrt.comm.bootstrap.prepare_singleton`).
"""
from psrt.comm.bootstrap import prepare_singleton

prepare_singleton()

from psrt.comm.base import Communicator, CompletedRequest, ReduceOp, Request  # noqa: E402

__all__ = ["Communicator", "CompletedRequest", "ReduceOp", "Request"]
