"""Handles of asynchronous collectives: ``poll`` and ``synchronize``, as in Horovod.

An ``*_async`` call returns an int handle; ``synchronize(handle)`` waits,
releases the handle and returns the collective's output.  Handles are the Horovod-shaped
facade's: psrt's own strategies wait on their :class:`~psrt.engine.work.Work` instead.  The table belongs to
the runtime, so a handle does not outlive the ``init()`` that issued it: after
``shutdown()`` and a new ``init()`` an old handle is reported unknown instead of
standing for a work of a stopped engine.
"""
from __future__ import annotations

import itertools
import threading
from typing import Callable, Protocol

from psrt.engine.work import Work
from psrt.errors import ArgumentTypeError, InvalidArgumentError


class Completion(Protocol):
    """What a handle stands for besides a single engine work: several completing together."""

    def done(self) -> bool: ...

    def result(self) -> object: ...


class HandleTable:
    """The pending asynchronous operations of one runtime, by handle; thread-safe.  A handle
    stands for a :class:`Work`, whose output ``wait_for_work`` returns (the engine's
    :meth:`~psrt.engine.Engine.wait`, which runs the engine's cycles on the waiting thread),
    or for a :class:`Completion`."""

    def __init__(self, wait_for_work: Callable[[Work], object]) -> None:
        self._wait_for_work = wait_for_work
        self._pending: dict[int, Work | Completion] = {}
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def register(self, completion: Work | Completion) -> int:
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
            if isinstance(completion, Work):
                return self._wait_for_work(completion)
            return completion.result()
        finally:
            with self._lock:
                self._pending.pop(handle, None)

    def _lookup(self, handle: object) -> Work | Completion:
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise ArgumentTypeError(f"handle must be the int returned by an *_async call, got "
                                    f"{type(handle).__name__}")
        completion = self._pending.get(handle)
        if completion is None:
            raise InvalidArgumentError(f"handle {handle} is unknown or was already synchronized")
        return completion
