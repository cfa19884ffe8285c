"""psrun's reading of a failed job: the failure line amid mpirun's output, and which
processes of a failed job it kills afterwards."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.failures import FailureKind, FailureScanner
from launcher.processes import leftover_processes, process_start_time

REPO = Path(__file__).resolve().parents[2]


def failure_of(*lines: str):
    scanner = FailureScanner()
    for line in lines:
        scanner.feed(line)
    return scanner.failure


@pytest.mark.parametrize("line", [
    " psrt: rank 0 failed: stall: rank 1 does not respond",           # after mpirun's " " line
    "psrt: rank 0 failed: stall: rank 1 does not respond" + "-" * 74,  # before its notice's dashes
    "[1,0]<stderr>: psrt: rank 0 failed: stall: rank 1 does not respond",
    "\x00psrt: rank 0 failed: stall: rank 1 does not respond",         # Open MPI's forwarding, seen in CI
])
def test_the_failure_line_is_found_amid_mpiruns_own_output(line):
    failure = failure_of(line)
    assert failure is not None and failure.summary() == "rank 0 failed first: stall: rank 1 does not respond"


def test_a_marker_after_the_abort_notice_replaces_it_even_behind_a_nul_byte():
    """Open MPI printed its MPI_ABORT notice first and the rank's marker after it, starting
    with a NUL byte; psrun once reported the bare abort instead of what the rank raised."""
    failure = failure_of(
        "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD", "  Proc: [[55606,1],1]", "  Errorcode: 1",
        "", "NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.", "-" * 74,
        "\x00psrt: rank 1 failed: psrt.init() raised InvalidArgumentError: "
        "PSRT_CYCLE_TIME='inf' must be a finite number")
    assert failure.summary() == ("rank 1 failed first: psrt.init() raised InvalidArgumentError: "
                                 "PSRT_CYCLE_TIME='inf' must be a finite number")


def test_a_failure_line_quoted_in_other_output_is_not_this_jobs_failure():
    """A rank may print another job's output (a driver of trials, say)."""
    assert failure_of("trial 3 said: psrt: rank 0 failed: raised ValueError: x") is None


def fake_process(root: Path, pid: int, session: int, state: str = "S", rank: int | None = None,
                 parent: int = 1) -> None:
    folder = root / str(pid)
    folder.mkdir()
    # pid (comm) state ppid pgrp session ...
    (folder / "stat").write_text(f"{pid} (python (x)) {state} {parent} {pid} {session} 0 0\n")
    environ = [b"PATH=/bin"] + ([f"OMPI_COMM_WORLD_RANK={rank}".encode()] if rank is not None else [])
    (folder / "environ").write_bytes(b"\0".join(environ) + b"\0")


def test_after_a_failed_job_its_ranks_launcher_and_stopped_processes_are_killed_not_rank_helpers(tmp_path):
    session = 100
    fake_process(tmp_path, 100, session)                            # mpirun itself, the session leader
    fake_process(tmp_path, 101, session, "T", rank=1, parent=100)   # a stopped rank
    fake_process(tmp_path, 102, session, "S", rank=0, parent=100)   # a rank still alive
    fake_process(tmp_path, 103, session, "Z", rank=2, parent=100)   # a rank already dead
    fake_process(tmp_path, 104, session, "S", parent=102)           # a helper rank 0 started (a log uploader)
    fake_process(tmp_path, 105, session, "T", parent=102)           # a stopped process rank 0 started
    fake_process(tmp_path, 106, session, "S", parent=100)           # the launch agent for another host
    fake_process(tmp_path, 107, session, "S", parent=106)           # the remote daemon it started
    fake_process(tmp_path, 108, 999, "T", rank=0)                   # another job's rank
    assert leftover_processes(session, str(tmp_path)) == [101, 102, 105, 106, 107]
    assert leftover_processes(session, str(tmp_path / "absent")) == []


# --- blame lines: the culprit headlines the job, not the rank that noticed -------------------

BLAME = "psrt: rank 0 blames rank 1 (worker 1): no answer to 3 requests for 5 s"


def test_a_blame_line_headlines_the_culprit_with_its_role_and_the_reporter():
    failure = failure_of(BLAME)
    assert failure.summary() == ("rank 1 (worker 1) is to blame: no answer to 3 requests for 5 s "
                                 "(reported by rank 0)")
    assert (failure.rank, failure.reporter, failure.kind) == (1, 0, FailureKind.BLAME)


def test_a_blame_line_without_a_role():
    assert failure_of("psrt: rank 2 blames rank 0: waits in allreduce 'g'").summary() == (
        "rank 0 is to blame: waits in allreduce 'g' (reported by rank 2)")


def test_a_blame_line_wins_over_the_reporters_marker_and_the_aborts_notices():
    marker = "psrt: rank 0 failed: stall: rank 1 does not respond"
    abort = ["MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD", "  Proc: [[55606,1],0]",
             "  Errorcode: 1"]
    killed = ["prterun noticed that process rank 1 with PID 7 on node vm exited on", "signal 9 (Killed)."]
    for lines in ([BLAME, marker, *abort], [marker, BLAME], [*abort, BLAME, marker]):
        assert failure_of(*lines).summary().startswith("rank 1 (worker 1) is to blame"), lines
    # A rank that really died first stays the headline (and elastic mode drops its slots).
    assert failure_of(*killed, BLAME).summary() == "rank 1 failed first: killed by signal 9 (SIGKILL)"
    other = ["prterun noticed that process rank 2 with PID 7 on node vm exited on", "signal 9 (Killed)."]
    assert failure_of(*other, BLAME).summary() == "rank 2 failed first: killed by signal 9 (SIGKILL)"


def test_the_first_blame_line_wins_and_an_earlier_marker_of_another_rank_stands():
    later = "psrt: rank 2 blames rank 3 (server 0): no answer"
    assert failure_of(BLAME, later).rank == 1
    other = "psrt: rank 2 failed: raised ValueError: boom"
    assert failure_of(other, BLAME).summary() == "rank 2 failed first: raised ValueError: boom"


def test_a_blame_line_is_found_behind_a_tag_a_nul_byte_and_a_progress_bar():
    for line in (f"[1,0]<stderr>: {BLAME}", f"\x00{BLAME}", f" 50%|#####     |\r{BLAME}"):
        assert failure_of(line).rank == 1, line


def test_a_blame_line_quoted_in_other_output_is_not_this_jobs_failure():
    assert failure_of(f"trial 3 said: {BLAME}") is None


# --- psrun killed: its watcher ends the job -------------------------------------------------

def _session_with_a_child() -> subprocess.Popen[bytes]:
    """A stand-in for mpirun: a session leader with a child of its own that ignores SIGTERM."""
    return subprocess.Popen(["sh", "-c", "sh -c 'trap \"\" TERM; sleep 60' & sleep 60"], start_new_session=True)


def _gone(pid: int) -> bool:
    return process_start_time(pid) is None


def test_the_watcher_ends_the_job_when_psrun_goes_without_saying_done(tmp_path):
    pipes = tmp_path / "psrun-stderr-x"  # what psrun would have removed after the job
    pipes.mkdir()
    mpirun = _session_with_a_child()
    watcher = subprocess.Popen([sys.executable, "-m", "launcher.lifeline"], stdin=subprocess.PIPE,
                               stderr=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 10
        while not leftover_processes(mpirun.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        child = leftover_processes(mpirun.pid)
        assert child, "the stand-in's child did not start"
        watcher.stdin.write(f"{mpirun.pid} {process_start_time(mpirun.pid)}\n{pipes}\n".encode())
        watcher.stdin.close()  # what psrun's death does to the pipe
        watcher.wait(timeout=30)
        err = watcher.stderr.read()
        mpirun.wait(timeout=5)
        assert all(_gone(pid) for pid in child) and not pipes.exists()
        assert f"psrun: killed while its job ran; its watcher stopped the job (mpirun pid {mpirun.pid}; killed pid " \
            in err.decode(), err
        assert str(child[0]) in err.decode().rsplit("killed pid", 1)[1]
    finally:
        for pid in leftover_processes(mpirun.pid):
            os.kill(pid, signal.SIGKILL)
        mpirun.kill()
        mpirun.wait()


def test_the_watcher_leaves_the_job_alone_once_told_done():
    mpirun = _session_with_a_child()
    try:
        done = subprocess.run([sys.executable, "-m", "launcher.lifeline"], input=f"{mpirun.pid} 0\ndone\n".encode(),
                              capture_output=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                              timeout=30, check=False)
        assert done.returncode == 0 and done.stderr == b"" and mpirun.poll() is None
    finally:
        os.killpg(mpirun.pid, signal.SIGKILL)
        mpirun.wait()


def _hydra_notices(scanner: FailureScanner, ends: dict[int, str]) -> None:
    """Hydra's notices of every rank's end, in rank order, as MPICH prints them on its stdout."""
    for rank, how in sorted(ends.items()):
        for line in ("=" * 80, "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
                     f"=   RANK {rank} PID {1000 + rank} RUNNING AT node1", f"=   {how}", "=" * 80):
            scanner.feed(line, "mpirun stdout")


def test_under_hydra_the_rank_whose_stderr_closed_first_headlines_the_job():
    scanner = FailureScanner()
    scanner.ended([1])
    scanner.ended([0, 2])
    _hydra_notices(scanner, {0: "KILLED BY SIGNAL: 9 (Killed)", 1: "KILLED BY SIGNAL: 9 (Killed)",
                             2: "KILLED BY SIGNAL: 9 (Killed)"})
    assert scanner.failure.summary() == "rank 1 failed first: killed by signal 9 (SIGKILL)"


def test_under_hydra_ranks_that_ended_together_are_named_together_not_the_lowest_alone():
    scanner = FailureScanner()
    scanner.ended([0, 1])
    _hydra_notices(scanner, {0: "KILLED BY SIGNAL: 9 (Killed)", 1: "KILLED BY SIGNAL: 9 (Killed)"})
    assert scanner.failure.summary().startswith("one of ranks 0, 1 failed first: killed by signal 9 (SIGKILL)")


def test_under_hydra_a_rank_that_exited_is_told_from_those_killed_with_it():
    scanner = FailureScanner()
    scanner.ended([0, 1])
    _hydra_notices(scanner, {0: "KILLED BY SIGNAL: 9 (Killed)", 1: "EXIT CODE: 3"})
    assert scanner.failure.summary() == "rank 1 failed first: exited with code 3"
    without_pipes = FailureScanner()
    _hydra_notices(without_pipes, {0: "EXIT CODE: 3", 1: "KILLED BY SIGNAL: 9 (Killed)"})
    assert without_pipes.failure.summary() == "rank 0 failed first: exited with code 3"


def test_a_psrt_marker_wins_over_hydras_notices():
    scanner = FailureScanner()
    scanner.feed("psrt: rank 1 failed: raised ValueError: boom", 1)
    scanner.ended([0, 1])
    _hydra_notices(scanner, {0: "EXIT CODE: 1", 1: "EXIT CODE: 1"})
    assert scanner.failure.summary() == "rank 1 failed first: raised ValueError: boom"


def test_under_mpich_the_process_it_names_is_turned_into_its_rank():
    scanner = FailureScanner(rank_of_pid={13141: 1}.get)
    for line in ("", "=" * 80, "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES", "=   PID 13141 RUNNING AT vm",
                 "=   EXIT CODE: 11", "=   CLEANING UP REMAINING PROCESSES", "=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES",
                 "=" * 80, "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Segmentation fault (signal 11)"):
        scanner.feed(line, "mpirun stdout")
    assert scanner.failure.summary() == "rank 1 failed first: killed by signal 11 (SIGSEGV)"


LOST_DAEMON = """\
--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-node0-2201@0,0] on node node0
  Remote daemon: [prterun-node0-2201@0,1] on node node1

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------"""


def test_a_lost_host_is_named_with_the_ranks_placed_on_it():
    scanner = FailureScanner(ranks_on_host={"node0": [0, 1], "node1": [2, 3]}.get)
    for line in LOST_DAEMON.splitlines():
        scanner.feed(line)
    assert scanner.failure.summary() == ("rank 2 failed first: its host node1 stopped answering (the MPI lost its "
                                         "daemon there; ranks 2, 3 ran there)")


def test_a_lost_host_whose_ranks_are_unknown_is_named_alone():
    scanner = FailureScanner()
    for line in LOST_DAEMON.splitlines():
        scanner.feed(line)
    assert scanner.failure.kind is FailureKind.HOST
    assert scanner.failure.summary() == "host node1 stopped answering (the MPI lost its daemon there)"
