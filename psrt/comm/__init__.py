"""Transport layer: the :class:`Communicator` interface and its MPI and NCCL backends.

Nothing above this package imports mpi4py or cupy.  Importing mpi4py starts MPI, which
happens here, before any module of this package imports it: watched in a job, with the
singleton's transport settings in a process that no launcher started (see
:func:`psrt.comm.bootstrap.start_mpi_at_import`).
"""
from psrt.comm.bootstrap import start_mpi_at_import

start_mpi_at_import()

from psrt.comm.base import Communicator, CompletedRequest, ElementwiseOp, Request  # noqa: E402

__all__ = ["Communicator", "CompletedRequest", "ElementwiseOp", "Request"]
