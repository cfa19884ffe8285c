"""Handles of asynchronous collectives: ``poll`` and ``synchronize``, as in Horovod.

An ``*_async`` call returns an int handle; ``synchronize(handle)`` waits,
releases the handle and returns the collective's output.
"""
from __future__ import annotations

import itertools
import threading
from typing import Protocol

from psrt.errors import ArgumentTypeError, InvalidArgumentError


class Completion(Protocol):
    """What a handle stands for: an engine work, or several completing together."""

    def done(self) -> bool: ...

    def result(self) -> object: ...


_pending: dict[int, Completion] = {}
_counter = itertools.count()
_lock = threading.Lock()


def register(completion: Completion) -> int:
    with _lock:
        handle = next(_counter)
        _pending[handle] = completion
    return handle


def _lookup(handle: object) -> Completion:
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise ArgumentTypeError(f"handle must be the int returned by an *_async call, got "
                                f"{type(handle).__name__}")
    completion = _pending.get(handle)
    if completion is None:
        raise InvalidArgumentError(f"handle {handle} is unknown or was already synchronized")
    return completion


def poll(handle: int) -> bool:
    """True if the asynchronous operation behind ``handle`` has completed."""
    return _lookup(handle).done()


def synchronize(handle: int) -> object:
    """Wait for the operation behind ``handle``, release the handle, return its output."""
    completion = _lookup(handle)
    try:
        return completion.result()
    finally:
        with _lock:
            _pending.pop(handle, None)
