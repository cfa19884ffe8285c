"""psrt: a distributed training runtime for PyTorch on MPI and NCCL.

User scripts normally ``import psrt.torch as hvd``; this package holds the
framework-independent basics (start-up, ranks, process sets, errors).
"""
from psrt.errors import (ArgumentTypeError, CollectiveMismatchError, CommunicationError,
                         EngineStoppedError, InvalidArgumentError, InvalidArgumentTypeError, NotInitializedError,
                         ParameterServerError, ProcessSetError, PsrtError, UnsupportedDeviceError,
                         UnsupportedOperationError)
from psrt.runtime import (add_process_set, cross_rank, cross_size, global_process_set, init,
                          is_initialized, local_rank, local_size, rank, remove_process_set,
                          shutdown, size, tuning_table)
from psrt.topology import ProcessSet

__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError", "CollectiveMismatchError", "CommunicationError", "EngineStoppedError",
    "InvalidArgumentError", "InvalidArgumentTypeError", "NotInitializedError", "ParameterServerError",
    "ProcessSet", "ProcessSetError", "PsrtError", "UnsupportedDeviceError", "UnsupportedOperationError",
    "add_process_set", "cross_rank", "cross_size", "global_process_set", "init",
    "is_initialized", "local_rank", "local_size", "rank", "remove_process_set", "shutdown",
    "size", "tuning_table",
]
