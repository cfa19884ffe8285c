"""Handles of asynchronous collectives: ``poll`` and ``synchronize``, as in Horovod.

An ``*_async`` call returns an int handle; ``synchronize(handle)`` waits,
releases the handle and returns the collective's output.  The table belongs to
the runtime, so a handle does not outlive the ``init()`` that issued it: after
``shutdown()`` and a new ``init()`` an old handle is reported unknown instead of
standing for a work of a stopped engine.
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


class HandleTable:
    """The pending asynchronous operations of one runtime, by handle; thread-safe."""

    def __init__(self) -> None:
        self._pending: dict[int, Completion] = {}
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def register(self, completion: Completion) -> int:
        with self._lock:
            handle = next(self._counter)
            self._pending[handle] = completion
        return handle

    def poll(self, handle: object) -> bool:
        """True if the asynchronous operation behind ``handle`` has completed."""
        return self._lookup(handle).done()

    def synchronize(self, handle: object) -> object:
        """Wait for the operation behind ``handle``, release the handle, return its output."""
        completion = self._lookup(handle)
        try:
            return completion.result()
        finally:
            with self._lock:
                self._pending.pop(handle, None)

    def _lookup(self, handle: object) -> Completion:
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise ArgumentTypeError(f"handle must be the int returned by an *_async call, got "
                                    f"{type(handle).__name__}")
        completion = self._pending.get(handle)
        if completion is None:
            raise InvalidArgumentError(f"handle {handle} is unknown or was already synchronized")
        return completion
