"""Tensor and pipeline parallelism with CUDA tensors against the CPU with torch alone.

Skips cleanly where no GPU is present.  Two ranks: the pipeline runs even when they
share one GPU; the tensor-parallel block needs a GPU per rank (NCCL)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "tp_pp_cuda_check.py"


def test_pipeline_and_tensor_parallel_block_on_cuda_match_the_cpu():
    done = psrun("-np", "2", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tp pp cuda check ok" in done.stdout, done.stdout + done.stderr
