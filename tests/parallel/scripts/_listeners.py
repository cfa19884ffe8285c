"""What every process of the psrun job this rank belongs to listens on: psrun, its lifeline,
the MPI launcher and its daemons (on every host of the multi-host test bed, which shares
this machine's processes), the ranks and what they started (the rank watchers).

A rank takes the snapshot while the whole job is up; the tests check that nothing listens
beyond loopback (and the interface the job was given) but the launcher, whose sockets
psrun's note must name (see launcher/listeners.py).
"""
from __future__ import annotations

import json
import os

from launcher.listeners import exposed, listening, process_tree
from launcher.processes import is_rank, parent_of


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace")


def _psrun() -> int:
    """The psrun this process runs under (its nearest ancestor running launcher.cli)."""
    pid = psrun_pid()
    if pid is None:
        raise AssertionError(f"rank {os.getpid()} runs under no psrun")
    return pid


def psrun_pid() -> int | None:
    """The psrun this process runs under, or None (srun or mpirun started it)."""
    pid = os.getppid()
    while pid > 1:
        if "launcher.cli" in _cmdline(pid) or "/psrun" in _cmdline(pid):
            return pid
        pid = parent_of(pid) or 0
    return None


def _role(pid: int, psrun: int) -> str:
    if pid == psrun:
        return "psrun"
    try:
        if "launcher.lifeline" in _cmdline(pid):
            return "lifeline"
        return "rank" if is_rank(pid) else "launcher"
    except OSError:
        return "gone"


def snapshot() -> list[dict]:
    """Every listening socket of the job: its holder's pid, program and role, and where it
    listens (``exposed``: beyond loopback)."""
    psrun = _psrun()
    found = listening(process_tree(psrun))
    beyond = set(exposed(found))
    return [{"pid": s.pid, "program": s.program, "role": _role(s.pid, psrun), "listens_on": str(s),
             "exposed": s in beyond} for s in found]


def snapshot_line() -> str:
    """The snapshot as one line of output, which tests/listener_checks.py reads back."""
    return "listeners: " + json.dumps(snapshot())


def check_only_the_launcher_listens_beyond_loopback(name: str) -> list[dict]:
    """Raise unless every exposed socket of the job is the MPI launcher's; returns the snapshot."""
    sockets = snapshot()
    others = [s for s in sockets if s["exposed"] and s["role"] != "launcher"]
    assert not others, f"{name}: listening beyond loopback besides the launcher: {json.dumps(others)}"
    return sockets
