"""``@hvd.elastic.run``: run a training function from the last commit, and stop it for a
relaunch when the hosts change.

Horovod re-forms its workers in place; an MPI job cannot, so under ``psrun --min-np
--max-np`` every change of membership is a relaunch, and the function picks up from the
commit when the job starts again.  The outcomes are Horovod's: after a failed rank
(``HorovodInternalError`` in Horovod) training continues from the last commit on the
ranks that remain; after ``HostsUpdatedInterrupt`` from the commit that raised it.
"""
from __future__ import annotations

import functools

from psrt import runtime
from psrt.elastic.state import State
from psrt.errors import ArgumentTypeError, HostsUpdatedInterrupt


def run(func):
    """Decorate ``func(state, *args, **kwargs)``; calling it restores the last commit of an
    earlier launch (then runs the state's reset callbacks) or, on a first launch, makes every
    rank hold rank 0's state (``state.sync()``), and runs ``func``.

    Collective: every rank of the world calls the decorated function, in the same order.

    :param func: the training function; its first argument is a :class:`State`.
    :returns: the decorated function, taking the same arguments.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise ArgumentTypeError(f"{func.__name__}(state, ...): the first argument of an elastic function must be "
                                    f"a psrt.elastic State (TorchState, ObjectState), got {type(state).__name__}")
        if state._resume():
            state.on_reset()
        else:
            state.sync()
        try:
            return func(state, *args, **kwargs)
        except HostsUpdatedInterrupt:
            if runtime.rank() == 0:
                state._store.request_reset("the hosts changed")
            runtime.shutdown()
            raise SystemExit(0) from None  # psrun relaunches on the new hosts

    return wrapper
