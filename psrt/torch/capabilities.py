"""What this build of psrt can carry, under Horovod's names (``hvd.nccl_built()``...),
so scripts that choose their device or backend from them keep working."""
from __future__ import annotations

import torch

from psrt.comm.nccl import nccl_available


def mpi_built() -> bool:
    """MPI carries every host-tensor collective."""
    return True


def mpi_enabled() -> bool:
    return True


def mpi_threads_supported() -> bool:
    """psrt initialises MPI with ``MPI_THREAD_MULTIPLE``."""
    return True


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> bool:
    """True when CUDA tensors can be carried (CuPy's NCCL bindings and a GPU)."""
    return nccl_available()


def cuda_built() -> bool:
    return torch.cuda.is_available()


def rocm_built() -> bool:
    return False


def ccl_built() -> bool:
    """oneCCL is not a psrt backend."""
    return False
