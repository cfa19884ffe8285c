"""Transport layer: the :class:`Communicator` interface and its MPI and NCCL backends.

Nothing above this package imports mpi4py or cupy.
"""
from psrt.comm.base import Communicator, CompletedRequest, ReduceOp, Request

__all__ = ["Communicator", "CompletedRequest", "ReduceOp", "Request"]
