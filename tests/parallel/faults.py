"""Fault injection from outside a running job, as a cluster inflicts it: freeze a rank
(SIGSTOP: a node stuck in I/O, a hung driver) or kill it, once the job is under way.

:func:`run_with_fault` launches a script with psrun (a :class:`jobs.Job`), waits for a
line of its output, signals one rank (found by its job rank and a tag psrun forwards to
every rank of this job only), and reports how and how fast the job ended, and whether
any process of it outlived the job.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from jobs import Job, psrun_argv, start_job

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@dataclass
class FaultedJob:
    returncode: int | None  # None: still running at the timeout (then killed)
    seconds_after_fault: float
    stdout: str
    stderr: str
    left_behind: list[int]  # processes of the job alive after psrun returned
    log: str = ""  # the rest of a failed job's stderr, from the log psrun names

    @property
    def all_stderr(self) -> str:
        """What psrun showed and what it wrote to its log."""
        return f"{self.stderr}\n{self.log}"

    def diagnosis(self) -> str:
        return (f"exit {self.returncode} {self.seconds_after_fault:.1f} s after the fault; left behind "
                f"{self.left_behind}\n--- stdout ---\n{self.stdout[-2000:]}\n--- stderr ---\n{self.stderr[-4000:]}"
                f"\n--- psrun's log ---\n{self.log[-4000:]}")


def job_processes(tag: str, rank: int | None = None) -> list[int]:
    """Live (not zombie) processes of the job tagged ``tag``: its ranks, or one of them."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if f"PSRT_TEST_JOB={tag}".encode() not in environ or state == b"Z":
            continue
        # Open MPI's mpirun names a rank in OMPI_COMM_WORLD_RANK, Hydra (MPICH, Intel MPI) in PMI_RANK.
        ranks = [v.split(b"=", 1)[1] for v in environ if v.startswith((b"OMPI_COMM_WORLD_RANK=", b"PMI_RANK="))]
        if ranks and (rank is None or ranks[0] == str(rank).encode()):
            found.append(int(entry))
    return found


def run_with_fault(script: str, np: int, args: tuple[str, ...], env: Mapping[str, str], *, after: str,
                   rank: int, signum: int, timeout_s: float = 90.0, psrun_args: tuple[str, ...] = ()) -> FaultedJob:
    """Run ``script`` on ``np`` ranks (``psrun_args`` before ``-np``); once stdout has a line
    starting with ``after``, send ``signum`` to job rank ``rank``; wait up to ``timeout_s``
    for the job to end."""
    def fault(job: Job, tag: str) -> float:
        job.wait_for_line(f"^{re.escape(after)}", timeout_s)
        for pid in job_processes(tag, rank):
            os.kill(pid, signum)
        return time.time()
    job, returncode, left, faulted_at = _run_tagged(script, np, args, env, timeout_s, fault, psrun_args)
    return FaultedJob(returncode, job.ended_at - faulted_at, job.out, job.err, left, job.log)


def run_until_it_ends(script: str, np: int, args: tuple[str, ...], env: Mapping[str, str], *,
                      blocked: str = "BLOCKED", timeout_s: float = 90.0) -> FaultedJob:
    """Run ``script`` on ``np`` ranks, each of which prints a line starting with ``blocked``
    just before it makes a call that goes wrong (a deadlock, a rank left behind): the fault
    is the last of those lines, and the job must end on its own within ``timeout_s``."""
    job, returncode, left, _ = _run_tagged(script, np, args, env, timeout_s)
    marks = [at for at, line in job.stdout if line.startswith(blocked)]
    faulted_at = max(marks) if marks else float("nan")
    return FaultedJob(returncode, job.ended_at - faulted_at, job.out, job.err, left, job.log)


def _run_tagged(script: str, np: int, args: tuple[str, ...], env: Mapping[str, str], timeout_s: float,
                act: Callable[[Job, str], float] | None = None,
                psrun_args: tuple[str, ...] = ()) -> tuple[Job, int | None, list[int], float]:
    """Run ``script`` tagged so that its processes can be found, ``act`` on it while it runs
    (returning when), and wait for its end: (the job, psrun's exit code, the processes it
    left behind, what ``act`` returned).  No process of the job outlives this."""
    tag = uuid.uuid4().hex
    job = start_job(psrun_argv(*psrun_args, "-np", str(np), sys.executable, str(SCRIPTS / script), *args),
                    f"`psrun {' '.join(psrun_args)} -np {np} {script} {' '.join(args)}`", {**env, "PSRT_TEST_JOB": tag})
    try:
        acted_at = act(job, tag) if act is not None else float("nan")
        returncode = job.finish(timeout_s)
        left = _left_behind(tag)
    finally:
        for pid in job_processes(tag):
            os.kill(pid, signal.SIGKILL)
        job.stop()
    return job, returncode, left, acted_at


def _left_behind(tag: str, patience_s: float = 3.0) -> list[int]:
    """The job's processes still alive a moment after psrun returned (killed ones need a
    moment to be reaped)."""
    deadline = time.monotonic() + patience_s
    while (left := job_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
