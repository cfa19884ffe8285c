"""The torch API of psrt, shaped like Horovod's: ``import psrt.torch as hvd``.

``hvd.elastic`` is Horovod's name for psrt's elastic training, :mod:`psrt.elastic`, which builds on
this package: the name is resolved on first use (:func:`__getattr__`), so that this package does
not depend on the one built above it.

Collectives take CPU tensors (the MPI backend); every one has an ``_async``
form returning a handle for :func:`poll` and :func:`synchronize`, and a
``process_set=`` argument (default: all ranks).  The out-of-place collectives are
differentiable, as in Horovod (:mod:`psrt.torch.collectives`, one module per family).

Importing it registers the ``"psrt"`` backend of ``torch.distributed`` and, in a process an MPI
launcher started, sets torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE`` where they are missing (:mod:`psrt.rank_env`).
"""
import importlib

from psrt.errors import CollectiveMismatchError as HorovodInternalError
from psrt.runtime import (add_process_set, cross_rank, cross_size, global_process_set, init,
                          is_initialized, local_rank, local_size, rank, remove_process_set,
                          shutdown, size, start_timeline, stop_timeline)
from psrt.topology import ProcessSet
from psrt.torch.capabilities import (ccl_built, cuda_built, gloo_built, gloo_enabled, mpi_built,
                                     mpi_enabled, mpi_threads_supported, nccl_built, rocm_built)
from psrt.torch.collectives.allgather import (allgather, allgather_async, allgather_into_async, grouped_allgather,
                                              grouped_allgather_async)
from psrt.torch.collectives.allreduce import allreduce, allreduce_, allreduce_async, allreduce_async_
from psrt.torch.collectives.grouped_allreduce import (grouped_allreduce, grouped_allreduce_, grouped_allreduce_async,
                                                      grouped_allreduce_async_, sparse_allreduce_async)
from psrt.torch.collectives.alltoall import alltoall, alltoall_async
from psrt.torch.collectives.barrier import barrier
from psrt.torch.collectives.broadcast import broadcast, broadcast_, broadcast_async, broadcast_async_
from psrt.torch.collectives.reducescatter import (grouped_reducescatter, grouped_reducescatter_async, reducescatter,
                                                  reducescatter_async)
from psrt.torch.compression import Compression
from psrt.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state,
                                  broadcast_parameters, join)
from psrt.torch.handles import poll, synchronize
from psrt.torch.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from psrt.torch.optimizer import Bucketing, DistributedOptimizer
from psrt.torch.sync_batch_norm import SyncBatchNorm
from psrt.rank_env import fill_from_launcher as _fill_from_launcher
from psrt.torch.c10d import process_group, register as _register_torch_backend

_register_torch_backend()  # dist.init_process_group("psrt") from here on
_fill_from_launcher()  # torchrun's RANK, LOCAL_RANK... under any MPI launcher, for torch's tools

__all__ = [
    "Adasum", "Average", "Bucketing", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max",
    "Min", "ProcessSet", "Product", "ReduceOp", "Sum", "SyncBatchNorm", "add_process_set",
    "allgather", "allgather_async", "allgather_into_async", "allgather_object", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast",
    "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "process_group", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown",
    "size", "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize",
]


def __getattr__(name: str):
    if name == "elastic":
        return importlib.import_module("psrt.elastic")
    raise AttributeError(f"module 'psrt.torch' has no attribute {name!r}")
