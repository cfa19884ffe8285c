"""The watcher of MPI's start-up and finalisation (``psrt/comm/startup.py``), run as the process
it is, on a stand-in for a rank that waits in MPI's start-up or finalisation (a sleeping
process)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import psrt.comm.startup as startup

WATCHER = [sys.executable, "-I", "-S", startup.__file__]


def watch(rank_process: subprocess.Popen, arrivals: str, check: str = "0.3", shutdown: str = "0.8"):
    return subprocess.Popen([*WATCHER, "0", "2", check, shutdown, arrivals, str(rank_process.pid)],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_start_up_past_the_shutdown_time_is_reported_naming_the_missing_rank_and_ended(tmp_path: Path):
    (tmp_path / "0").touch()  # rank 0 has started MPI, rank 1 has not
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = watch(rank, str(tmp_path))
    assert rank.wait(timeout=30) == -9, "the rank is ended"
    watcher.wait(timeout=10)
    stderr = watcher.stderr.read()
    report, blame, failed = stderr.strip().splitlines()
    assert report.startswith("psrt: stall: MPI's start-up (MPI_Init_thread, when psrt is imported) on rank 0")
    assert "rank 1 has not started MPI" in report
    assert blame == "psrt: rank 0 blames rank 1: has not started MPI after 0.8 s"
    assert failed.startswith("psrt: rank 0 failed: stall: MPI's start-up") and failed.endswith(
        "(PSRT_STALL_SHUTDOWN_TIME=0.8 s)")


def test_a_start_up_that_ends_in_time_leaves_the_rank_alone_and_says_nothing():
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = watch(rank, "", check="5", shutdown="10")
    time.sleep(0.3)
    _, stderr = watcher.communicate(input="", timeout=30)  # the rank closes the pipe: MPI started
    assert watcher.returncode == 0 and stderr == ""
    assert rank.poll() is None
    rank.kill()


def children() -> set[int]:
    """This process's children, as Linux lists them (zombies included)."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        found.update(int(pid) for pid in (task / "children").read_text().split())
    return found


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
def test_the_start_up_watcher_is_reaped_once_told_that_mpi_started(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.delenv("PMIX_SERVER_TMPDIR", raising=False)  # no marks left anywhere
    before = children()
    watch = startup.StartupWatch(60.0, 120.0)
    watcher = children() - before
    assert len(watcher) == 1
    watch.stop()
    deadline = time.monotonic() + 60  # a hang guard: a zombie stays a child for good
    while children() & watcher and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not children() & watcher, "the watcher was left a zombie child"


def test_an_exit_past_the_shutdown_time_is_reported_naming_the_unfinished_rank_and_ended(tmp_path: Path):
    (tmp_path / "0").touch()  # rank 0 has reached its exit, rank 1 has not
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = subprocess.Popen([*WATCHER, "0", "2", "0.3", "0.8", str(tmp_path), str(rank.pid), startup.EXIT],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert rank.wait(timeout=30) == -9, "the rank is ended"
    watcher.wait(timeout=10)
    report, blame, failed = watcher.stderr.read().strip().splitlines()
    assert report.startswith("psrt: stall: MPI's finalisation (MPI_Finalize, at the end of the process, after "
                             "psrt.shutdown()) on rank 0")
    assert "rank 1 has not finished" in report
    assert blame == "psrt: rank 0 blames rank 1: has not finished after 0.8 s"
    assert failed.startswith("psrt: rank 0 failed: stall: MPI's finalisation") and failed.endswith(
        "(PSRT_STALL_SHUTDOWN_TIME=0.8 s)")


def test_the_exit_watcher_leaves_silently_when_the_rank_ends_even_if_its_child_holds_the_pipe():
    # A stand-in rank starts the watcher at its exit, forks a child that keeps every inherited
    # descriptor but the output, and ends: the watcher must see it gone, and say nothing.
    rank = subprocess.run([sys.executable, "-c", f"""
import os, sys, time
sys.path.insert(0, {str(Path(startup.__file__).parent)!r})
import startup
startup.watch_exit(1.0, 2.0)
if os.fork() == 0:
    os.close(1), os.close(2)
    time.sleep(4)
    os._exit(0)
time.sleep(0.5)  # the watcher is watching by now
"""], capture_output=True, text=True, timeout=30, check=False,
                          env={"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert rank.returncode == 0 and rank.stderr == "", rank.stderr
