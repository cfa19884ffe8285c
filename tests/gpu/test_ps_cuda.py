"""Parameter-server mode with CUDA tensors on the workers, against CPU references.

The servers are CPU processes: CUDA tensors are staged through host memory.  Skips
cleanly where no GPU is present; one GPU is enough (the server never touches it).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ps_cuda_check.py"


def test_cuda_tensors_push_pull_and_train_like_the_cpu_reference():
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "-np", "2", "--num-servers", "1",
                           sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ps cuda check ok" in done.stdout, done.stdout + done.stderr
