"""DP and ZeRO 0-3 steps on one GPU make no host synchronisation (sync debug mode "error") and
equal torch alone bitwise.  Skips cleanly where no GPU is present.  A pipeline step needs two
GPUs for NCCL (two ranks on one GPU take the host-staged path, which waits by design)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "sync_free_check.py"


def test_dp_and_zero_steps_wait_for_no_host_and_equal_torch_bitwise():
    done = psrun("-np", "1", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sync free check ok" in done.stdout, done.stdout + done.stderr
