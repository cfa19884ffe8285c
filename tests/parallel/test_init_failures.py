"""A failure inside ``init()`` ends the job at once, and psrun names the rank and the reason.

Before, an exception raised inside ``init()`` before the abort hook was installed left
the other ranks waiting in init's collectives forever, and psrun summarised a
configuration error as ``exited with code 1``.  Each job here runs ``scripts/init_failures.py``.
"""
from __future__ import annotations

import pytest

from conftest import launch

pytestmark = pytest.mark.parallel

LIMIT_S = 40  # start-up of 2 ranks on a loaded 2-core machine, then the abort


def summary(report) -> str:
    return report.stderr.strip().splitlines()[-1]


def test_a_configuration_error_on_one_rank_ends_the_job_naming_the_variable():
    report = launch("init_failures.py", 2, args=("config_on_one_rank",), timeout_s=90)
    assert report.returncode not in (0, None) and report.seconds < LIMIT_S, report.diagnosis()
    assert summary(report) == ("psrun: rank 1 failed first: psrt.init() raised InvalidArgumentError: "
                               "PSRT_CYCLE_TIME='inf' must be a finite number"), report.diagnosis()
    assert "RESULT" not in report.stdout


def test_an_error_after_start_up_began_on_one_rank_ends_the_job_naming_it():
    report = launch("init_failures.py", 2, args=("process_set_on_one_rank",), timeout_s=90)
    assert report.returncode not in (0, None) and report.seconds < LIMIT_S, report.diagnosis()
    assert summary(report) == ("psrun: rank 1 failed first: psrt.init() raised ProcessSetError: process set "
                               "ranks [7] are outside the world of size 2"), report.diagnosis()


@pytest.mark.parametrize(("env", "reason"), [
    ({"PSRT_CYCLE_TIME": "nan"}, "InvalidArgumentError: PSRT_CYCLE_TIME='nan' must be a finite number"),
    ({"PSRT_NUM_SERVERS": "2"}, "InvalidArgumentError: 2 parameter servers in a job of 2 ranks"),
])
def test_a_configuration_error_on_every_rank_is_summarised_with_its_reason(env, reason):
    report = launch("init_failures.py", 2, env, args=("plain",), timeout_s=90)
    assert report.returncode not in (0, None) and report.seconds < LIMIT_S, report.diagnosis()
    assert summary(report).startswith("psrun: rank ") and f"failed first: psrt.init() raised {reason}" \
        in summary(report), report.diagnosis()
