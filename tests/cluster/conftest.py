"""The SLURM cluster of :mod:`slurm`, built once per session and always torn down; skipped,
saying why, where the machine cannot hold it (not root, no namespaces, SLURM or munge not
installed)."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multihost"))
from netns import bed_for_session, skip_reason as bed_skip_reason  # noqa: E402
from slurm import SlurmCluster, skip_reason  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """Two SLURM nodes of 2 CPUs each."""
    yield from bed_for_session(lambda: SlurmCluster(f"psrt-s{os.getpid() % 100000}-", 2,
                                                    tmp_path_factory.mktemp("slurm")),
                               "SLURM test bed", bed_skip_reason() or skip_reason())
