"""ZeRO with CUDA parameters: stages 0-3 against a CPU reference, and a checkpoint round trip.

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

SCRIPT = Path(__file__).resolve().parent / "scripts" / "zero_cuda_check.py"


def test_zero_on_cuda_trains_like_the_cpu_reference_and_checkpoints():
    done = psrun("-np", "1", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "zero cuda check ok" in done.stdout, done.stdout + done.stderr
