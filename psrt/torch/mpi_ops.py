"""``psrt.torch.mpi_ops``: the module path Horovod code imports its collectives from
(``from horovod.torch.mpi_ops import synchronize, allreduce_async, poll``).

It holds the very objects of :mod:`psrt.torch`, under the names Horovod's ``mpi_ops``
defines, so such imports keep working after ``horovod`` becomes ``psrt``.
"""
from __future__ import annotations

from psrt.torch import (Adasum, Average, HorovodInternalError, Max, Min, ProcessSet, Product, Sum,
                        add_process_set, allgather, allgather_async, allreduce, allreduce_, allreduce_async,
                        allreduce_async_, alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async,
                        broadcast_async_, ccl_built, cross_rank, cross_size, cuda_built, global_process_set,
                        gloo_built, gloo_enabled, grouped_allgather, grouped_allgather_async, grouped_allreduce,
                        grouped_allreduce_, grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                        grouped_reducescatter_async, init, is_initialized, join, local_rank, local_size, mpi_built,
                        mpi_enabled, mpi_threads_supported, nccl_built, poll, rank, reducescatter,
                        reducescatter_async, remove_process_set, rocm_built, shutdown, size, sparse_allreduce_async,
                        start_timeline, stop_timeline, synchronize)

__all__ = [
    "Adasum", "Average", "HorovodInternalError", "Max", "Min", "ProcessSet", "Product", "Sum", "add_process_set",
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall",
    "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "global_process_set", "gloo_built", "gloo_enabled",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "init", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]
