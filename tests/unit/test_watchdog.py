"""The watchdog behind stall reports for TP collectives and pipeline messages."""
from __future__ import annotations

import threading
import time

from psrt.comm.watchdog import Watchdog


def test_a_wait_past_the_shutdown_time_ends_the_job_naming_it():
    ended: list[str] = []
    watchdog = Watchdog(check_s=0.0, shutdown_s=0.5, end_job=ended.append)
    with watchdog.waiting(lambda: "pipeline rank 0's receive of micro-batch 3"):
        time.sleep(1.6)
    watchdog.stop()
    assert ended and "pipeline rank 0's receive of micro-batch 3 has waited" in ended[0]
    assert "PSRT_STALL_SHUTDOWN_TIME=0.5 s" in ended[0]


def test_short_waits_are_not_reported_and_stop_ends_the_thread():
    ended: list[str] = []
    watchdog = Watchdog(check_s=60.0, shutdown_s=0.0, end_job=ended.append)
    with watchdog.waiting(lambda: "never described"):
        pass
    watchdog.stop()
    assert not ended
    assert not any(t.name == "psrt-watchdog" and t.is_alive() for t in threading.enumerate())
