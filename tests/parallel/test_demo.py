"""The README's demo command works end to end: ``make demo`` runs the
collectives demo on 2 ranks and every rank reports what it got."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parallel
def test_make_demo_runs_every_collective_on_two_ranks():
    venv = Path(sys.prefix)
    # Run the demo target in the environment running the tests, without re-installing.
    command = ["make", "-s", "-o", str(venv / ".psrt-installed"), "demo", f"VENV={venv}", "NP=2"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "psrt demo: 2 ranks" in out and "psrt demo: all collectives completed" in out
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] allreduce \(Sum\) +\[10\.0, 12\.0, 14\.0, 16\.0\]", out)
        assert re.search(rf"\[rank {rank}\] allgather \(rank\+1 rows\) +\[0, 1, 1\]", out)
    assert re.search(r"\[rank 0\] alltoall received +\[0, 100, 101\] splits \[1, 2\]", out)
    assert re.search(r"\[rank 1\] reducescatter \(Sum\) +\[2\.0, 2\.0\]", out)
