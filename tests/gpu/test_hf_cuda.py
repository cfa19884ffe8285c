"""A model psrt did not write, split over two pipeline ranks with CUDA parameters and loaded
from its own checkpoint onto the GPU, against the unsplit model on the same GPU
(scripts/hf_cuda_check.py).

Skips cleanly where no GPU is present; the two ranks share one GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "hf_cuda_check.py"


def test_split_model_on_cuda_matches_one_process_and_loads_onto_the_gpu():
    done = psrun("-np", "2", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hf cuda check ok" in done.stdout, done.stdout + done.stderr
