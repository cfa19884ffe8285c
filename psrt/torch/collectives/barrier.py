"""Barrier over a process set, through the engine like any collective."""
from __future__ import annotations

from psrt import runtime
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier.

    It runs through the engine like any collective, so outstanding async
    operations keep progressing around it.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param process_set: the ranks that wait for each other: a registered process set this rank
        belongs to; default ``global_process_set`` (every rank).
    """
    current = runtime.current()
    channel = current.channel(process_set)
    channel.run(channel.barrier())
