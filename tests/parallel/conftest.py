"""The ``parallel_jobs`` fixture: each check-script job the tests ask for runs once per session,
most of them inside job servers (see job_server.py), and the tests assert on its individual
checks (see check_jobs.py)."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from check_jobs import REPO, SCRIPTS, launch
from job_server import CheckJobs
from jobs import UNTUNED

__all__ = ["REPO", "SCRIPTS", "launch"]  # what test files import from here
os.environ.update(UNTUNED)  # for the tests that start psrun themselves (see jobs.UNTUNED)


@pytest.fixture(scope="session")
def parallel_jobs() -> Iterator[CheckJobs]:
    jobs = CheckJobs()
    yield jobs
    jobs.close()
