"""Tie a job's life to psrun's: when psrun dies, even from SIGKILL, its mpirun and ranks end too.

mpirun runs in a session of its own (so that a Ctrl-C reaches it once, through psrun), which
also means nothing ends it when psrun is killed outright: it and every rank would run on with
parent 1. So psrun starts a small watcher process beside mpirun, in a session of its own too
(a signal to psrun's process group does not reach it), and keeps the write end of a pipe
whose read end is the watcher's stdin. psrun writes mpirun's process id into the pipe once
mpirun runs (and what psrun would remove after it), and ``done`` once mpirun has ended. A pipe reaches end-of-file when its last
writer goes, however that writer died: a watcher that reads end-of-file without ``done``
asks mpirun to terminate the job (SIGTERM, as a Ctrl-C would, so that ranks on other hosts
end too), and after a grace period kills whatever of the job is left on this host.

Run as ``python -m launcher.lifeline``; :class:`Lifeline` is psrun's end of it.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from launcher.processes import leftover_processes, process_start_time

__all__ = ["TERMINATE_GRACE_S", "Lifeline", "end_orphaned_job"]

# How long mpirun gets to end its job after SIGTERM before the watcher kills what is left.
TERMINATE_GRACE_S = 3.0
_POLL_S = 0.05
_DONE = "done"


class Lifeline:
    """psrun's end of the watcher: start it before mpirun, :meth:`watch` mpirun, then
    :meth:`release` once mpirun has ended. Where the watcher cannot start, the job runs
    without one (as before) and psrun says so."""

    def __init__(self) -> None:
        self._write_end: int | None = None
        self._watcher: subprocess.Popen[bytes] | None = None
        read_end, write_end = os.pipe()
        try:
            self._watcher = subprocess.Popen(
                [sys.executable, "-m", "launcher.lifeline"], stdin=read_end, stdout=subprocess.DEVNULL,
                start_new_session=True, close_fds=True,
                env={**os.environ, "PYTHONPATH": _launcher_path()},
            )
        except OSError as e:
            os.close(write_end)
            print(f"psrun: warning: cannot start the watcher that ends the job if psrun is killed ({e}); "
                  "a killed psrun would leave the job running", file=sys.stderr, flush=True)
        else:
            self._write_end = write_end
        finally:
            os.close(read_end)

    def watch(self, pid: int, leftover_paths: Sequence[str] = ()) -> None:
        """Tell the watcher which mpirun to end should psrun die, and what psrun would have
        removed after it (directories with no newline in their names)."""
        self._send(f"{pid} {process_start_time(pid)}\n" + "".join(f"{path}\n" for path in leftover_paths))

    def release(self) -> None:
        """mpirun has ended: the watcher has nothing left to do."""
        self._send(f"{_DONE}\n")
        if self._write_end is not None:
            os.close(self._write_end)
            self._write_end = None
        if self._watcher is not None:
            try:
                self._watcher.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _send(self, text: str) -> None:
        if self._write_end is None:
            return
        try:
            os.write(self._write_end, text.encode())
        except OSError:  # the watcher died: nothing it could do for us now
            os.close(self._write_end)
            self._write_end = None


def _launcher_path() -> str:
    """PYTHONPATH that finds this very ``launcher`` package first, whatever the caller's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))


def _alive(pid: int, start_time: int | None) -> bool:
    """``pid`` still runs and is the process that was watched (not a reused process id)."""
    started = process_start_time(pid)
    return started is not None and (start_time is None or started == start_time)


def _remove(paths: Sequence[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def end_orphaned_job(pid: int, start_time: int | None, grace_s: float = TERMINATE_GRACE_S) -> list[int]:
    """psrun is gone: terminate mpirun ``pid`` (a session leader), then kill what is left of its
    session on this host after ``grace_s``; returns the process ids that had to be killed."""
    if _alive(pid, start_time):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (_alive(pid, start_time) or leftover_processes(pid)):
        time.sleep(_POLL_S)
    killed = []
    for _ in range(3):  # a process may fork while the others die
        left = ([pid] if _alive(pid, start_time) else []) + leftover_processes(pid)
        if not left:
            break
        for victim in left:
            try:
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
            except ProcessLookupError:
                pass
        time.sleep(_POLL_S)
    return sorted(set(killed))


def _main() -> int:
    """The watcher: read mpirun's process id and the paths to remove after it, then wait for
    ``done`` or end-of-file."""
    received = sys.stdin.buffer.read().decode(errors="replace").splitlines()
    if _DONE in received or not received:
        return 0
    try:
        pid_text, start_text = received[0].split()
        pid, start_time = int(pid_text), None if start_text == "None" else int(start_text)
    except ValueError:
        return 2
    killed = end_orphaned_job(pid, start_time) if _alive(pid, start_time) or leftover_processes(pid) else None
    _remove(received[1:])
    if killed is not None:
        print(f"psrun: killed while its job ran; its watcher stopped the job (mpirun pid {pid}"
              + (f"; killed pid {', '.join(map(str, killed))}" if killed else "") + ")",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
