"""Fixtures of the multi-host tests: the test bed of :mod:`netns` (built once per session,
always torn down; skipped, saying why, where the machine does not allow it) and jobs on
this machine alone."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

import pytest

from jobs import Job, psrun_argv, start_job
from netns import Testbed, bed_for_session, skip_reason


@pytest.fixture(scope="session")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    """Two hosts, built once per session and always torn down."""
    yield from bed_for_session(lambda: Testbed(f"psrt-t-{os.getpid()}-", 2, tmp_path_factory.mktemp("multihost")),
                               "multi-host test bed", skip_reason())


@pytest.fixture(scope="session")
def one_host() -> Callable[..., Job]:
    """Start ``psrun args`` on this machine alone (no test bed needed)."""
    def start(*args: str, env: Mapping[str, str] | None = None) -> Job:
        return start_job(psrun_argv(*args), f"one-host `psrun {' '.join(args)}`", env)
    return start
