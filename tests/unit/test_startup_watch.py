"""The watcher of MPI's start-up (``psrt/comm/startup.py``), run as the process it is, on a
stand-in for a rank that waits in MPI's start-up (a sleeping process)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

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
