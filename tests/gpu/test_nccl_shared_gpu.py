"""NCCL with two ranks on one GPU, attempted (scripts/nccl_shared_gpu_attempt.py): NCCL
normally refuses, which is why psrt stages such ranks through host memory.  Either outcome
passes and is recorded (the ``nccl_two_ranks_one_gpu`` property of the JUnit report, which
``tests/gpu/check.py`` copies into its results file); a hang or a wrong sum fails.

Skips cleanly where CuPy or a GPU is missing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("cupy", reason="the NCCL backend needs CuPy (pip install psrt[gpu])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "nccl_shared_gpu_attempt.py"


def test_nccl_with_two_ranks_on_one_gpu_is_attempted_and_recorded(record_property):
    try:
        done = psrun("-np", "2", sys.executable, str(SCRIPT), timeout_s=120)
    except subprocess.TimeoutExpired:
        record_property("nccl_two_ranks_one_gpu", "hung")
        pytest.fail("two ranks creating an NCCL communicator on one GPU hung for 120 s")
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"nccl_two_ranks_one_gpu"')]
    assert lines, f"no outcome reported (exit code {done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    report = json.loads(lines[-1])
    record_property("nccl_two_ranks_one_gpu", report["nccl_two_ranks_one_gpu"])
    record_property("nccl_two_ranks_one_gpu_detail", " | ".join(report["ranks"])[:500])
    assert report["nccl_two_ranks_one_gpu"] in ("refused", "works"), report
