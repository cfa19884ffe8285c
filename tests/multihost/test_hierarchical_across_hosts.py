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


def test_a_job_over_two_hosts_measures_the_hierarchical_path_and_stays_exact(testbed, tmp_path) -> None:
    """Tuning on (no PSRT_HIERARCHICAL_ALLREDUCE): the job's first init measures MPI's
    allreduce, psrt's ring and the hierarchical path across the hosts, writes the table, and
    every allreduce is exact by whichever path the table picks for its size."""
    table_file = tmp_path / "tuning.json"
    job = testbed.psrun("-np", "4", sys.executable, JOB, slots=2,
                        env={"PSRT_TUNE": "measure", "PSRT_TUNE_FILE": str(table_file)})
    assert job.finish(JOB_TIMEOUT_S) == 0, job.diagnosis()
    reports = [json.loads(line) for line in job.out.splitlines() if line.startswith("{")]
    assert len(reports) == 4 and all(report["failures"] == [] for report in reports), job.diagnosis()
    table = json.loads(table_file.read_text())
    assert table["key"]["ranks_per_host"] == [2, 2], table["key"]
    measured = table["measurements"]["allreduce"]
    assert measured and all("hierarchical_us" in point for point in measured), measured
    assert {band["algorithm"] for band in table["hierarchical_allreduce"]} <= {"mpi", "ring", "hierarchical"}
