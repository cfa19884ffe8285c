"""Hierarchical allreduce across two "hosts" (network namespaces, see netns.py) of two ranks
each, turned on by ``PSRT_HIERARCHICAL_ALLREDUCE=1``: every result exact against the
reference each rank computes, and the hierarchical path actually taken for the global
set (while a registered process set stays flat). One launch (``hierarchical_job.py``)."""
from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.parallel

JOB = str(Path(__file__).resolve().parent / "hierarchical_job.py")
JOB_TIMEOUT_S = 180.0
ENV = {"PSRT_HIERARCHICAL_ALLREDUCE": "1", "PSRT_RING_THRESHOLD": str(64 << 10)}


@pytest.fixture(scope="module")
def reports(testbed) -> dict[int, dict]:
    """Each rank's JSON line from the 2 hosts x 2 ranks job."""
    job = testbed.psrun("-np", "4", sys.executable, JOB, slots=2, env=ENV)
    assert job.finish(JOB_TIMEOUT_S) == 0, job.diagnosis()
    lines = [json.loads(line) for line in job.out.splitlines() if line.startswith("{")]
    found = {line["rank"]: line for line in lines}
    assert sorted(found) == [0, 1, 2, 3], job.diagnosis()
    return found


def test_job_ran_two_ranks_on_each_of_two_hosts(reports, testbed) -> None:
    hosts = [reports[rank]["host"] for rank in range(4)]
    assert hosts == [socket.gethostname()] * 2 + [testbed.hosts[1].namespace] * 2


def test_hierarchical_allreduce_across_hosts_is_exact(reports) -> None:
    for rank, report in reports.items():
        assert report["failures"] == [], f"rank {rank}: wrong results for {report['failures']}"


def test_hierarchical_path_is_taken_for_the_global_set_only(reports) -> None:
    counts = {report["hierarchical_allreduces"] for report in reports.values()}
    assert {report["transport"] for report in reports.values()} == {"HierarchicalCommunicator"}
    assert len(counts) == 1 and counts.pop() > 0, f"hierarchical allreduces by rank: {reports}"
    assert {report["process_set_transport"] for report in reports.values()} == {"MpiCommunicator"}
