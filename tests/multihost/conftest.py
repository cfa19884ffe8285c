"""Fixtures of the multi-host tests: the test bed of :mod:`netns` (built once per session,
always torn down; skipped, saying why, where the machine does not allow it) and jobs on
this machine alone."""
from __future__ import annotations

import atexit
import os
from collections.abc import Callable, Iterator, Mapping

import pytest

from jobs import Job, psrun_argv, start_job
from netns import SetupRefused, Testbed, skip_reason


@pytest.fixture(scope="session")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    """Two hosts, built once per session and always torn down."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(f"multi-host test bed unavailable: {reason}")
    bed = Testbed(f"psrt-t-{os.getpid()}-", 2, tmp_path_factory.mktemp("multihost"))
    atexit.register(bed.destroy)  # in case the session dies before the fixture's teardown
    try:
        bed.build()
    except SetupRefused as e:
        bed.destroy()
        pytest.skip(f"multi-host test bed unavailable: {e}")
    try:
        yield bed
    finally:
        leftovers = bed.destroy()
        assert not leftovers, f"network namespaces left behind: {leftovers}"


@pytest.fixture(scope="session")
def one_host() -> Callable[..., Job]:
    """Start ``psrun args`` on this machine alone (no test bed needed)."""
    def start(*args: str, env: Mapping[str, str] | None = None) -> Job:
        return start_job(psrun_argv(*args), f"one-host `psrun {' '.join(args)}`", env)
    return start
