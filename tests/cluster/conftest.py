"""The SLURM cluster of :mod:`slurm`, built once per session and always torn down; skipped,
saying why, where the machine cannot hold it (not root, no namespaces, SLURM or munge not
installed)."""
from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multihost"))
from netns import SetupRefused, skip_reason as bed_skip_reason  # noqa: E402
from slurm import SlurmCluster, skip_reason  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Two SLURM nodes of 2 CPUs each."""
    reason = bed_skip_reason() or skip_reason()
    if reason is not None:
        pytest.skip(f"SLURM test bed unavailable: {reason}")
    built = SlurmCluster(f"psrt-s{os.getpid() % 100000}-", 2, tmp_path_factory.mktemp("slurm"))
    atexit.register(built.destroy)  # in case the session dies before the fixture's teardown
    try:
        built.start()
    except SetupRefused as e:
        built.destroy()
        pytest.skip(f"SLURM test bed unavailable: {e}")
    try:
        yield built
    finally:
        leftovers = built.destroy()
        assert not leftovers, f"network namespaces left behind: {leftovers}"
