"""Jobs that go wrong on purpose, one per mode (``psrun -np 2 python engine_failures.py MODE``).

``stall_abort``   rank 0 waits on a tensor that rank 1 never submits; with
                  PSRT_STALL_CHECK_TIME / PSRT_STALL_SHUTDOWN_TIME set the job
                  must end on its own, naming the tensor and rank 1.
``stall_warning`` rank 1 submits 2.5 s late; a warning names it and the job ends well.
``join_stall``    rank 0 joins; rank 1 joins 6 s later, past the stall shutdown time: the
                  stall report names the join and rank 1, and the job still ends well
                  (waiting in a join is by design, never a reason to end a job).
``shutdown``      rank 1 shuts psrt down while rank 0 waits on a collective: rank 0's
                  synchronize raises, naming rank 1, instead of hanging.
``join_shutdown`` rank 1 shuts psrt down; rank 0's join raises naming it (a join needs
                  every rank) and both ranks exit.
``express_failure`` the reduction of a repeated blocking allreduce (which the caller runs
                  itself, see ``Engine.express``) fails on the last rank: that rank's call
                  raises, naming the collective and the failure, and its engine stops (later
                  calls raise too); with PSRT_ABORT_ON_EXCEPTION on (the default) and more
                  than one rank, the job is aborted instead, so no rank waits on it.
``shutdown_sets`` rank 1 shuts psrt down first: rank 0's collectives on a process set
                  without rank 1 still run, those with rank 1 raise naming it, and rank
                  1's shutdown returns once rank 0 has shut down too.
Each rank prints ``RESULT <json>`` lines the test reads.
"""
from __future__ import annotations

import json
import sys
import time

import torch

import psrt
import psrt.torch as hvd


def report(**fields: object) -> None:
    print("RESULT " + json.dumps({"rank": psrt.rank() if psrt.is_initialized() else None,
                                  **fields}), flush=True)


def stall_abort() -> None:
    if hvd.rank() == 0:
        hvd.allreduce(torch.ones(2), name="stuck_tensor")
        report(unexpected="the stalled allreduce returned")
    else:
        time.sleep(120)  # never submits; the job must be ended for it


def stall_warning() -> None:
    if hvd.rank() == 1:
        time.sleep(2.5)
    got = hvd.allreduce(torch.ones(2), name="late_tensor", op=hvd.Sum)
    report(value=got.tolist())


def join_stall() -> None:
    if hvd.rank() == 1:
        time.sleep(6)
    report(last_to_join=hvd.join())


def shutdown(cached: bool = False) -> None:
    """Rank 1 shuts down while rank 0 blocks in an allreduce; ``cached``: the name ran
    before, so rank 0's call takes the express path (see ``Engine.express``) and learns of
    the shutdown from its round."""
    if cached:
        for _ in range(2):
            hvd.allreduce(torch.ones(2), name="orphan")
    if hvd.rank() == 1:
        time.sleep(0.5)
        hvd.shutdown()
        report(shut_down=True)
        return
    try:
        hvd.allreduce(torch.ones(2), name="orphan")
        report(error=None)
    except psrt.EngineStoppedError as exc:
        report(error=str(exc), kind=type(exc).__name__)
    try:
        hvd.allreduce(torch.ones(2), name="after")
        report(after=None)
    except psrt.EngineStoppedError as exc:
        report(after=str(exc))


def express_failure() -> None:
    tensor = torch.ones(2)
    for _ in range(2):  # the name is cached: the next call runs its reduction on this thread
        hvd.allreduce_(tensor, name="doomed", op=hvd.Sum)
    if hvd.rank() == hvd.size() - 1:
        route = next(iter(psrt.runtime.current().calls.values())).prepared.route

        def broken(*args: object) -> None:
            raise psrt.CommunicationError("injected transport failure")

        route.comm.allreduce = broken
        route.prepared = broken  # the express path's call, prepared for the tensor's address
    for call in ("doomed", "later"):
        try:
            hvd.allreduce_(tensor, name=call, op=hvd.Sum)
            report(**{call: None})
        except psrt.EngineStoppedError as exc:
            report(**{call: str(exc)})


def join_shutdown() -> None:
    if hvd.rank() == 1:
        hvd.shutdown()
        report(shut_down=True)
        return
    try:
        hvd.join()
        report(join=None)
    except psrt.EngineStoppedError as exc:
        report(join=str(exc))


def shutdown_sets() -> None:
    alone = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    if hvd.rank() == 1:
        hvd.shutdown()
        report(shut_down=True)
        return
    time.sleep(1.0)  # rank 1 is in shutdown by now
    got = hvd.allreduce(torch.ones(2), name="alone", op=hvd.Sum, process_set=alone[0])
    report(alone=got.tolist())
    try:
        hvd.allreduce(torch.ones(2), name="everyone")
        report(everyone=None)
    except psrt.EngineStoppedError as exc:
        report(everyone=str(exc))


if __name__ == "__main__":
    psrt.init()
    modes = {"stall_abort": stall_abort, "stall_warning": stall_warning, "join_stall": join_stall,
             "shutdown": shutdown, "shutdown_cached": lambda: shutdown(cached=True),
             "shutdown_sets": shutdown_sets, "join_shutdown": join_shutdown, "express_failure": express_failure}
    modes[sys.argv[1]]()
