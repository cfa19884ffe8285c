"""``poll`` and ``synchronize`` on the handles of ``*_async`` calls, as in Horovod; the
handles live in the runtime's table (:mod:`psrt.engine.handles`)."""
from __future__ import annotations

from psrt import runtime


def poll(handle: int) -> bool:
    """True if the asynchronous operation behind ``handle`` has completed."""
    return runtime.current().handles.poll(handle)


def synchronize(handle: int) -> object:
    """Wait for the operation behind ``handle``, release the handle, return its output."""
    return runtime.current().handles.synchronize(handle)
