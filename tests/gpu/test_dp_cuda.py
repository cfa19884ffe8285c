"""``DistributedOptimizer`` and ``SyncBatchNorm`` with a CUDA model, against a CPU reference.

Skips cleanly where no GPU is present; one GPU is enough (one rank).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "dp_cuda_check.py"


def test_distributed_optimizer_on_cuda_trains_like_the_cpu_reference():
    done = psrun("-np", "1", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "dp cuda check ok" in done.stdout, done.stdout + done.stderr
