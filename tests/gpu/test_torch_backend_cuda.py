"""psrt's torch.distributed backend on CUDA tensors (scripts/torch_backend_cuda_check.py):
NCCL collectives, stream order of a waited ``Work``, DDP and FSDP2 against the same training
on the GPU without a process group.  One rank (NCCL refuses two ranks on one device).

Skips cleanly where CuPy or a GPU is missing."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("cupy", reason="the NCCL backend needs CuPy (pip install psrt[gpu])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "torch_backend_cuda_check.py"


def test_torch_distributed_on_psrt_with_cuda_tensors_matches_one_process():
    done = psrun("-np", "1", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch backend cuda check ok" in done.stdout, done.stdout + done.stderr
