"""The NCCL backend on CUDA tensors, against the same collectives on CPU tensors.

Skips cleanly where CuPy or a GPU is missing.  One GPU is enough for the
single-rank checks; the two-rank job needs two GPUs (NCCL refuses two ranks
on one device).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("cupy", reason="the NCCL backend needs CuPy (pip install psrt[gpu])")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import psrt.torch as hvd  # noqa: E402
from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "nccl_check.py"


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.int8, torch.uint8, torch.int16, torch.int32,
                                   torch.int64])
def test_single_rank_cuda_collectives_match_cpu(dtype):
    cpu = (torch.arange(24).reshape(6, 4) % 5).to(dtype)
    cuda = cpu.cuda()
    for op in (hvd.Sum, hvd.Min, hvd.Max):
        assert torch.equal(hvd.allreduce(cuda, op=op).cpu(), hvd.allreduce(cpu, op=op))
    assert torch.equal(hvd.allgather(cuda).cpu(), hvd.allgather(cpu))
    assert torch.equal(hvd.broadcast(cuda, 0).cpu(), hvd.broadcast(cpu, 0))
    assert torch.equal(hvd.alltoall(cuda)[0].cpu(), hvd.alltoall(cpu)[0])
    if dtype.is_floating_point:
        assert torch.equal(hvd.reducescatter(cuda, op=hvd.Sum).cpu(),
                           hvd.reducescatter(cpu, op=hvd.Sum))


def test_cuda_async_allreduce_completes_on_the_stream():
    tensor = torch.ones(1 << 20, device="cuda")
    handle = hvd.allreduce_async_(tensor, op=hvd.Sum, postscale_factor=3.0)
    assert hvd.synchronize(handle) is tensor
    assert torch.equal(tensor.cpu(), torch.full((1 << 20,), 3.0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_on_two_gpus_match_the_cpu_reference():
    done = psrun("-np", "2", sys.executable, str(SCRIPT))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("nccl check ok") == 2, done.stdout


def test_single_rank_async_and_grouped_collectives_on_cuda_match_cpu():
    cpu = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    cuda = cpu.cuda()
    pairs = [
        (hvd.allreduce_async(cuda, op=hvd.Average, name="a.cuda"), hvd.allreduce(cpu, op=hvd.Average)),
        (hvd.allgather_async(cuda, name="g.cuda"), hvd.allgather(cpu)),
        (hvd.broadcast_async(cuda, 0, name="b.cuda"), hvd.broadcast(cpu, 0)),
        (hvd.reducescatter_async(cuda, op=hvd.Sum, name="r.cuda"), hvd.reducescatter(cpu, op=hvd.Sum)),
    ]
    for handle, want in pairs:
        assert torch.equal(hvd.synchronize(handle).cpu(), want)
    got, _ = hvd.synchronize(hvd.alltoall_async(cuda, name="t.cuda"))  # a handle gives (rows, splits)
    assert torch.equal(got.cpu(), hvd.alltoall(cpu))  # without splits, the call gives the rows alone
    for got, want in zip(hvd.grouped_allreduce([cuda, 2 * cuda], op=hvd.Sum), [cpu, 2 * cpu]):
        assert got.is_cuda and torch.equal(got.cpu(), want)
    for got, want in zip(hvd.grouped_allgather([cuda, cuda[:1]]), [cpu, cpu[:1]]):
        assert torch.equal(got.cpu(), want)
    for got, want in zip(hvd.grouped_reducescatter([cuda, cuda + 1]), [cpu, cpu + 1]):
        assert torch.equal(got.cpu(), want)
