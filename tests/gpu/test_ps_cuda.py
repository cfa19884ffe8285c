"""Parameter-server mode with CUDA tensors on the workers, against CPU references.

The servers are CPU processes: CUDA tensors are staged through host memory.  Skips
cleanly where no GPU is present; one GPU is enough (the server never touches it).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ps_cuda_check.py"


def test_cuda_tensors_push_pull_and_train_like_the_cpu_reference():
    done = psrun("-np", "2", "--num-servers", "1", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ps cuda check ok" in done.stdout, done.stdout + done.stderr
