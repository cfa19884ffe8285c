"""A real timeline read back by ``psrt timeline-summary``: a 2-rank job
(``scripts/timeline_job.py``) records one, and the summary accounts for every tensor it
reduced, step by step, with the time split adding up to the wall time."""
from __future__ import annotations

import json

import pytest

from conftest import launch
from psrt import cli
from psrt.timeline_summary import summarize

pytestmark = pytest.mark.parallel


def test_the_summary_accounts_for_every_tensor_of_a_real_job(tmp_path, capsys):
    path = str(tmp_path / "trace.json")
    report = launch("timeline_job.py", 2, args=(path,), timeout_s=90)
    report.assert_complete(["timeline_written"])
    report.assert_ok("timeline_written")
    job = next(json.loads(line) for line in report.stdout.splitlines() if line.startswith('{"submitted"'))
    s = summarize(path)
    assert not s.truncated and s.rank == 0
    assert {name: [s.collectives[name], s.calls[name]] for name in s.calls} == job["submitted"]
    assert len(s.step_walls) == job["steps"]
    # the broadcast opens step 0; every step then holds the three gradients and the loss
    assert s.step_ops == [1 + 4] + [4] * (job["steps"] - 1)
    assert sum(s.total.values()) == pytest.approx(s.wall, rel=1e-9)
    assert s.total["collective"] > 0 and s.step_cycles is not None and all(s.step_cycles)
    assert cli.main(["timeline-summary", path]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in job["submitted"]), out
