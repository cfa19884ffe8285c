"""No wait on a peer is unwatched (issue 27): psrt's main paths, run under the checker of
``unwatched.py`` (loaded into every rank by ``unwatched_site/sitecustomize.py``), make no wait
on another rank outside a watchdog mark, from import to exit.

Two jobs of ``scripts/audit_job.py``: the engine, data parallelism, ZeRO, TP, PP, CP, EP and
the plan probe on 2 ranks; a parameter server and its 2 workers.  A new wait on other ranks
that nobody marks makes the rank that made it list it (``UNWATCHED n rank r <wait> at
<psrt frames>``), and the test fails showing that line.  The main job also makes one
unmarked wait on purpose, which the checker must list: a checker that stopped seeing waits
would fail the test too.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import launch

pytestmark = pytest.mark.parallel

SITE = Path(__file__).resolve().parent / "unwatched_site"
# The unmarked wait the main job makes on purpose: psrt's host groups, called from the job itself.
CONTROL = re.compile(r"at psrt/comm/bootstrap\.py:\d+ \(host_groups\) "
                     r"\(called from tests/parallel/scripts/audit_job\.py:")
AUDIT = re.compile(r"^UNWATCHED-AUDIT rank (\d+): (\d+) waits on peers, (\d+) unwatched$")


def audited(part: str, np: int, directory: Path, env: dict[str, str], control: bool = False) -> None:
    """Run a part of the audit job under the checker; with ``control``, the job's unmarked wait
    made on purpose must be listed on every rank, and nothing else."""
    report = launch("audit_job.py", np, {**env, "PSRT_TEST_UNWATCHED": "1", "PYTHONPATH": str(SITE)},
                    args=(part, str(directory)), timeout_s=180)
    assert report.returncode == 0 and "AUDIT DONE" in report.stdout, report.diagnosis()
    lines = report.stderr.replace("\0", "").splitlines()
    unwatched = [line for line in lines if line.startswith("UNWATCHED ")]
    on_purpose = [line for line in unwatched if CONTROL.search(line)]
    unwatched = [line for line in unwatched if not CONTROL.search(line)]
    assert not unwatched, "waits on other ranks that no watchdog covers:\n" + "\n".join(unwatched)
    if control:
        ranks = {int(line.split()[3]) for line in on_purpose}
        assert ranks == set(range(np)), f"the checker missed the unmarked wait made on purpose:\n{report.diagnosis()}"
    summaries = {int(m.group(1)): int(m.group(2)) for m in map(AUDIT.match, lines) if m}
    assert sorted(summaries) == list(range(np)), f"not every rank was audited:\n{report.diagnosis()}"
    assert all(waits > 0 for waits in summaries.values()), summaries


def test_engine_dp_zero_tp_pp_cp_ep_and_the_probe_wait_only_watched(tmp_path):
    audited("main", 2, tmp_path, {}, control=True)


def test_a_parameter_server_job_waits_only_watched(tmp_path):
    audited("ps", 3, tmp_path, {"PSRT_NUM_SERVERS": "1"})
