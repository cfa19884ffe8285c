"""A job that runs the check scripts it is handed, one after another inside the same ranks, so
that they start Python and import torch (and, at the first optimizer, ``torch._dynamo``) once
instead of once per script.

Rank 0 reads one JSON line per script from its standard input (``{"entry": n, "script": ...,
"args": [...], "env": {...}}``, or ``"quit"``) and hands it to the other ranks, which wait
for it asleep, not spinning, so that an idle server costs the machine nothing.  Every rank sets
``sys.argv`` to ``[script, *args]`` and ``os.environ`` to the job's environment plus ``env``
(only settings that ``psrt.init()`` or the harness reads: tests/parallel/job_server.py decides
which), runs the script as ``__main__`` (its ``main()`` calls ``psrt.init()``; the harness
reports its checks), then shuts psrt down, so that the next script starts from a fresh runtime
as in a job of its own.
Global state a script may change (random generators, default dtype, threads, working
directory, ``sys.path``, warning filters, a ``torch.distributed`` default group) is put back
before the next one.

Rank 0 brackets each script's report with ``{"job_server": "begin", "entry": n, ...}`` and
``{"job_server": "end", ...}`` lines.  A script that raises on a rank ends the job as it would
alone (psrt's abort on an uncaught exception), after a ``"failed"`` line naming it; one that
runs past ``SCRIPT_TIMEOUT_S`` ends the job after a ``"timeout"`` line; a hung check ends it
through the harness.  tests/parallel/job_server.py then starts a new server for what follows.
"""
from __future__ import annotations

import json
import os
import random
import runpy
import select
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

import psrt
import psrt.runtime

if TYPE_CHECKING:
    from mpi4py.MPI import Intracomm

SCRIPTS = Path(__file__).resolve().parent
SCRIPT_TIMEOUT_S = 240.0
_TIMEOUT_EXIT_CODE = 4
_ORDER_TAG = 31
_IDLE_POLL_S = 0.1
#: The process id of the test process that hands this server its scripts.
OWNER_VARIABLE = "JOB_SERVER_OWNER"
#: A server left idle this long ends (tests/parallel/job_server.py starts another if needed).
IDLE_LIMIT_S = 1200.0


def _emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


class _State:
    """What one script may change that the next would otherwise inherit."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.path = list(sys.path)
        self.cwd = os.getcwd()
        self.torch_rng = torch.random.get_rng_state()
        self.python_rng = random.getstate()
        self.numpy_rng = np.random.get_state()
        self.dtype = torch.get_default_dtype()
        self.threads = torch.get_num_threads()

    def restore(self, env: dict[str, str]) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.environ.update(env)
        sys.path[:] = self.path
        os.chdir(self.cwd)
        torch.random.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        np.random.set_state(self.numpy_rng)
        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_grad_enabled(True)


class _Deadline:
    """Ends the job if a script runs past its limit (a hang outside any check's watchdog)."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._lock = threading.Lock()
        self._entry: int | None = None
        self._script: str | None = None
        self._until = 0.0
        threading.Thread(target=self._watch, daemon=True, name="job-server-deadline").start()

    def set(self, entry: int | None, script: str | None = None) -> None:
        with self._lock:
            self._entry, self._script, self._until = entry, script, time.monotonic() + SCRIPT_TIMEOUT_S

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            with self._lock:
                expired = self._entry is not None and time.monotonic() > self._until
                entry, script = self._entry, self._script
            if expired:
                if self._rank == 0:
                    _emit({"job_server": "timeout", "entry": entry, "script": script,
                           "detail": f"not finished within {SCRIPT_TIMEOUT_S:g} s"})
                os._exit(_TIMEOUT_EXIT_CODE)


def _finish_script() -> None:
    """Leave no runtime or torch.distributed group behind for the next script."""
    if "torch.distributed" in sys.modules and torch.distributed.is_available() \
            and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    psrt.runtime.shutdown()


def _run(script: str, args: list[str]) -> None:
    sys.argv = [str(SCRIPTS / script), *args]
    try:
        runpy.run_path(str(SCRIPTS / script), run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


def _read_order() -> str:
    """Rank 0: the next line of standard input; "" once the test process that started this
    server is gone (mpirun does not pass on the end of its input) or after ``IDLE_LIMIT_S``."""
    owner = int(os.environ.get(OWNER_VARIABLE, "0"))
    idle_until = time.monotonic() + IDLE_LIMIT_S
    while time.monotonic() < idle_until:
        if select.select([sys.stdin], [], [], 1.0)[0]:
            return sys.stdin.readline().strip()
        if owner and not _alive(owner):
            return ""
    return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _next(comm: Intracomm) -> dict | None:
    """The next script to run, as rank 0 read it from its standard input; None to stop."""
    if comm.rank == 0:
        line = _read_order()
        order = json.loads(line) if line and line != '"quit"' else None
        for other in range(1, comm.size):
            comm.send(order, dest=other, tag=_ORDER_TAG)
        return order
    request = comm.irecv(source=0, tag=_ORDER_TAG)
    while True:
        done, order = request.test()
        if done:
            return order
        time.sleep(_IDLE_POLL_S)


def main() -> None:
    psrt.init()  # MPI started as psrt starts it; the scripts start runtimes of their own
    psrt.runtime.shutdown()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()  # the server's own: no script can match its messages
    rank = comm.rank
    state = _State()
    deadline = _Deadline(rank)
    while (order := _next(comm)) is not None:
        entry, script, args, env = order["entry"], order["script"], order["args"], order["env"]
        state.restore(env)
        if rank == 0:
            _emit({"job_server": "begin", "entry": entry, "script": script})
        start = time.monotonic()
        deadline.set(entry, script)
        try:
            with warnings.catch_warnings():
                _run(script, args)
            _finish_script()
        except BaseException as exc:
            _emit({"job_server": "failed", "entry": entry, "script": script, "rank": rank,
                   "detail": "".join(traceback.format_exception_only(type(exc), exc)).strip()[:1500]})
            raise  # psrt's abort on an uncaught exception ends every rank, as in a job of its own
        deadline.set(None)
        if rank == 0:
            _emit({"job_server": "end", "entry": entry, "script": script, "seconds": round(time.monotonic() - start, 3)})
    comm.Free()


if __name__ == "__main__":
    main()
