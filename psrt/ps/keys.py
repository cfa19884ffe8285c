"""A KVStore's keys as the worker knows them: where each key's chunks are and the headers
its pushes send, and the checks a call's key and tensor pass before anything is sent.

Every call names a key and most pass a tensor; a wrong one (a key never initialised, a
tensor of another shape or dtype) is an error on this worker alone, at once, never a
message a server refuses later.  Kept apart from :class:`psrt.ps.client.KVStore`, which
sends the requests, so that the checks read in one place.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from psrt.comm.buffers import SUPPORTED_DTYPES
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.ps.placement import Chunk


@dataclass(frozen=True)
class KeyRecord:
    """One initialised key: its shape and dtype, its chunks and where their pushes go."""

    shape: torch.Size
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]
    # per chunk: the server's rank, the push tag it gave and the header every push sends
    pushes: tuple[tuple[int, int, torch.Tensor], ...]
    servers: tuple[int, ...]  # the ranks of the servers holding the chunks

    def describe(self) -> str:
        return f"shape {list(self.shape)} {self.dtype}"


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements in contiguous host memory: the tensor itself where it is there
    (MPI reads any contiguous tensor as flat, so a push of one chunk needs no view)."""
    tensor = tensor.detach()
    return tensor if tensor.device.type == "cpu" and tensor.is_contiguous() else tensor.to("cpu").contiguous()


def check_init(key: str, tensor: torch.Tensor, reduce: str) -> None:
    """An init's key and initial value, for a store that reduces pushes by ``reduce``."""
    if not isinstance(key, str):
        raise ArgumentTypeError(f"init: key must be a str, got {type(key).__name__}")
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"init of key {key!r}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise InvalidArgumentError(f"init of key {key!r}: dtype {tensor.dtype} is not supported")
    if reduce == "mean" and not tensor.is_floating_point():
        raise InvalidArgumentError(f"init of key {key!r}: a {tensor.dtype} key cannot be averaged; "
                                   "create the KVStore with reduce='sum' for integer keys")


def known_key(keys: Mapping[str, KeyRecord], key: str, tensor: torch.Tensor | None, what: str) -> KeyRecord:
    """The record of ``key`` for a call (``what``: "push", "pull"), which must have been
    initialised; ``tensor``, if given, must have the key's shape and dtype."""
    if not isinstance(key, str):
        raise ArgumentTypeError(f"{what}: key must be a str, got {type(key).__name__}")
    info = keys.get(key)
    if info is None:
        raise InvalidArgumentError(f"{what} of key {key!r}: the key was never initialised; call "
                                   "init(key, tensor) on every worker first")
    if tensor is not None:
        if not isinstance(tensor, torch.Tensor):
            raise ArgumentTypeError(f"{what} of key {key!r}: expected a torch.Tensor, got "
                                    f"{type(tensor).__name__}")
        if tensor.shape != info.shape or tensor.dtype != info.dtype:
            raise InvalidArgumentError(f"{what} of key {key!r}: the key holds {info.describe()}, "
                                       f"got shape {list(tensor.shape)} {tensor.dtype}")
    return info
