"""Handles of asynchronous collectives: ``poll`` and ``synchronize``, as in Horovod.

An ``*_async`` call returns an int handle; ``synchronize(handle)`` waits,
releases the handle and returns the collective's output.
"""
from __future__ import annotations

import itertools
from typing import Callable

from psrt.comm.base import Request
from psrt.errors import ArgumentTypeError, InvalidArgumentError


class Pending:
    """A collective started on the transport, and how to produce its output once done."""

    __slots__ = ("request", "finish")

    def __init__(self, request: Request, finish: Callable[[], object]) -> None:
        self.request = request
        self.finish = finish

    def result(self) -> object:
        self.request.wait()
        return self.finish()


_pending: dict[int, Pending] = {}
_counter = itertools.count()


def register(pending: Pending) -> int:
    handle = next(_counter)
    _pending[handle] = pending
    return handle


def _lookup(handle: object) -> Pending:
    if isinstance(handle, bool) or not isinstance(handle, int):
        raise ArgumentTypeError(f"handle must be the int returned by an *_async call, got "
                                f"{type(handle).__name__}")
    if handle not in _pending:
        raise InvalidArgumentError(f"handle {handle} is unknown or was already synchronized")
    return _pending[handle]


def poll(handle: int) -> bool:
    """True if the asynchronous operation behind ``handle`` has completed."""
    return _lookup(handle).request.test()


def synchronize(handle: int) -> object:
    """Wait for the operation behind ``handle``, release the handle, return its output."""
    pending = _lookup(handle)
    try:
        return pending.result()
    finally:
        del _pending[handle]
