"""The processes of a job on this host, found through ``/proc`` by the session mpirun leads.

mpirun runs in a session of its own, and everything it starts on this host (the ranks, a
launch agent and the daemons it starts) stays in that session, whatever process groups they
form. That makes the session the one handle on what a job left behind: after a failed job,
and when psrun itself is gone (:mod:`launcher.lifeline`). Linux only; elsewhere nothing is
found.
"""
from __future__ import annotations

import os

__all__ = ["is_rank", "leftover_processes", "parent_of", "process_start_time"]

# Variables every MPI launcher psrun drives sets in its ranks (and in nothing else).
_RANK_VARIABLES = (b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=", b"PMI_RANK=")


def _stat_fields(pid: int | str, proc_root: str = "/proc") -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start_time(pid: int, proc_root: str = "/proc") -> int | None:
    """When ``pid`` started (clock ticks since boot), telling it from a later process given the
    same id; None if it is gone or a zombie."""
    fields = _stat_fields(pid, proc_root)
    if fields is None or len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def parent_of(pid: int | str, proc_root: str = "/proc") -> int | None:
    """The process id of ``pid``'s parent, or None if it is gone."""
    fields = _stat_fields(pid, proc_root)
    try:
        return None if fields is None else int(fields[1])
    except (IndexError, ValueError):
        return None


def is_rank(pid: int, proc_root: str = "/proc") -> bool:
    """True when ``pid`` is an MPI rank, or a process a rank started (they share its variables).
    Raises OSError where its environment cannot be read (it is gone, or not ours)."""
    with open(os.path.join(proc_root, str(pid), "environ"), "rb") as f:
        return any(v.startswith(_RANK_VARIABLES) for v in f.read().split(b"\0"))


def _session_processes(session: int, proc_root: str) -> dict[int, tuple[bytes, int, bool]]:
    """Live processes of this host in ``session``: pid -> (state, parent, is an MPI rank)."""
    found = {}
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit() or int(entry) == session:
            continue
        fields = _stat_fields(entry, proc_root)
        # after the command name: state, parent, process group, session
        try:
            if fields is None or len(fields) < 4 or int(fields[3]) != session or fields[0] == b"Z":
                continue
            rank = is_rank(int(entry), proc_root)
        except (OSError, ValueError):
            continue
        found[int(entry)] = (fields[0], int(fields[1]), rank)
    return found


def leftover_processes(session: int, proc_root: str = "/proc") -> list[int]:
    """What a job left on this host in ``session``: its ranks, the launcher's own
    processes (a launch agent and the daemons it started, which keep mpirun's output open)
    and anything stopped; not zombies (already dead), nor helpers a rank started on
    purpose, such as a log uploader, unless stopped."""
    processes = _session_processes(session, proc_root)

    def started_by_a_rank(pid: int) -> bool:
        parent = processes[pid][1]
        while parent in processes:
            if processes[parent][2]:
                return True
            parent = processes[parent][1]
        return False

    return sorted(pid for pid, (state, _, _) in processes.items()
                  if state in (b"T", b"t") or not started_by_a_rank(pid))
