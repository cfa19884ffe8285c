"""The single-process path of every collective: size 1, no launcher.

With one rank every collective is the identity (Average and Sum alike), so
these tests check shapes, dtypes, in-place semantics and argument errors.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import psrt
import psrt.torch as hvd

ALL_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64]


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.shutdown()


def sample(dtype: torch.dtype, shape=(3, 4)) -> torch.Tensor:
    return (torch.arange(12).reshape(shape) % 7).to(dtype)


def test_init_gives_a_world_of_one():
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size()) == (0, 1)
    hvd.init()  # idempotent
    assert hvd.is_initialized()


def test_horovod_capability_queries_describe_this_build():
    assert hvd.mpi_built() and hvd.mpi_enabled() and hvd.mpi_threads_supported()
    assert not hvd.gloo_built() and not hvd.rocm_built()
    assert hvd.nccl_built() == hvd.cuda_built() == torch.cuda.is_available()


def test_collective_before_init_raises_not_initialized():
    hvd.shutdown()
    with pytest.raises(psrt.NotInitializedError, match="init"):
        hvd.allreduce(torch.ones(2))
    with pytest.raises(psrt.NotInitializedError):
        hvd.rank()


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("op", [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product])
def test_allreduce_of_one_rank_is_identity(dtype, op):
    tensor = sample(dtype)
    result = hvd.allreduce(tensor, op=op)
    assert result.dtype == dtype and result is not tensor
    assert torch.equal(result, tensor)


def test_allreduce_scale_factors_apply_before_and_after():
    tensor = torch.tensor([1.0, 2.0])
    result = hvd.allreduce(tensor, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert torch.equal(result, torch.tensor([0.5, 1.0]))
    ints = hvd.allreduce(torch.tensor([7, -7]), op=hvd.Sum, postscale_factor=0.5)
    assert ints.tolist() == [3, -3]  # scaled in float64, truncated as Horovod does


def test_allreduce_in_place_returns_the_same_tensor_and_writes_non_contiguous_back():
    tensor = torch.arange(6.0).reshape(2, 3)
    assert hvd.allreduce_(tensor, op=hvd.Sum) is tensor
    view = torch.arange(6.0).reshape(2, 3).t()
    assert not view.is_contiguous()
    out = hvd.allreduce_(view, op=hvd.Max, prescale_factor=2.0)
    assert out is view and torch.equal(view, torch.arange(6.0).reshape(2, 3).t() * 2)


def test_empty_and_zero_dim_tensors():
    assert hvd.allreduce(torch.empty(0)).shape == (0,)
    assert hvd.allreduce(torch.tensor(2.5)).shape == ()
    assert hvd.allgather(torch.tensor(4)).tolist() == [4]
    assert hvd.allgather(torch.empty(0, 3)).shape == (0, 3)
    assert hvd.broadcast(torch.tensor(1.5), 0).item() == 1.5


def test_grouped_allreduce_mixed_dtypes_in_and_out_of_place():
    tensors = [torch.ones(3), torch.arange(4, dtype=torch.int32), torch.full((2, 2), 3.0)]
    results = hvd.grouped_allreduce(tensors, op=hvd.Sum)
    assert [r.dtype for r in results] == [t.dtype for t in tensors]
    assert all(torch.equal(r, t) for r, t in zip(results, tensors))
    assert all(a is b for a, b in zip(hvd.grouped_allreduce_(tensors), tensors))


def test_bool_min_max_and_data_movement():
    flags = torch.tensor([True, False])
    assert hvd.allreduce(flags, op=hvd.Min).tolist() == [True, False]
    assert hvd.allgather(flags).tolist() == [True, False]
    with pytest.raises(psrt.InvalidArgumentError, match="bool"):
        hvd.allreduce(flags, op=hvd.Sum)


def test_alltoall_and_reducescatter_of_one_rank():
    rows = torch.arange(10).reshape(5, 2)
    assert torch.equal(hvd.alltoall(rows), rows)  # without splits: the tensor alone, as in Horovod
    received, splits = hvd.alltoall(rows, splits=[5])
    assert torch.equal(received, rows) and splits.tolist() == [5]
    assert torch.equal(hvd.reducescatter(rows.float(), op=hvd.Sum), rows.float())


@pytest.mark.parametrize("collective", ["allreduce", "allgather", "broadcast", "alltoall",
                                        "reducescatter", "grouped_allreduce"])
def test_async_handles_poll_and_synchronize(collective):
    tensor = torch.arange(4.0)
    start = {
        "allreduce": lambda: hvd.allreduce_async(tensor),
        "allgather": lambda: hvd.allgather_async(tensor),
        "broadcast": lambda: hvd.broadcast_async(tensor, 0),
        "alltoall": lambda: hvd.alltoall_async(tensor),
        "reducescatter": lambda: hvd.reducescatter_async(tensor),
        "grouped_allreduce": lambda: hvd.grouped_allreduce_async([tensor]),
    }[collective]
    handle = start()
    assert isinstance(handle, int)
    while not hvd.poll(handle):
        pass
    hvd.synchronize(handle)
    with pytest.raises(psrt.InvalidArgumentError, match="already synchronized"):
        hvd.synchronize(handle)


def test_fp16_compression_returns_the_original_dtype():
    tensor = torch.tensor([1.0, 2.0], dtype=torch.float64)
    result = hvd.allreduce(tensor, compression=hvd.Compression.fp16)
    assert result.dtype == torch.float64 and torch.equal(result, tensor)


@pytest.mark.parametrize("call, error, message", [
    (lambda: hvd.allreduce([1.0]), psrt.ArgumentTypeError, "torch.Tensor"),
    (lambda: hvd.allreduce(torch.ones(2), op="sum"), psrt.ArgumentTypeError, "op must be"),
    (lambda: hvd.allreduce(torch.ones(2), op=99), psrt.InvalidArgumentError, "unknown"),
    (lambda: hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Adasum), psrt.InvalidArgumentError,
     "Adasum needs floating-point tensors, got torch.int32"),
    (lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum, average=True), psrt.InvalidArgumentError,
     "not both"),
    (lambda: hvd.allreduce(torch.ones(2), prescale_factor="2"), psrt.ArgumentTypeError,
     "prescale_factor"),
    (lambda: hvd.allreduce(torch.ones(2), name=3), psrt.ArgumentTypeError, "name"),
    (lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)), psrt.InvalidArgumentError,
     "complex64"),
    (lambda: hvd.allreduce(torch.empty(2, device="meta")), psrt.UnsupportedDeviceError, "meta"),
    (lambda: hvd.broadcast(torch.ones(2), root_rank=1), psrt.InvalidArgumentError,
     "root_rank 1 is not a member of the process set"),
    (lambda: hvd.broadcast(torch.ones(2), root_rank=0.0), psrt.ArgumentTypeError, "root_rank"),
    (lambda: hvd.alltoall(torch.ones(4), splits=[3]), psrt.InvalidArgumentError, "sum to 3"),
    (lambda: hvd.alltoall(torch.ones(4), splits=[2, 2]), psrt.InvalidArgumentError, "2 entries"),
    (lambda: hvd.reducescatter(torch.tensor(1.0)), psrt.InvalidArgumentError, "dimension"),
    (lambda: hvd.grouped_allreduce(torch.ones(2)), psrt.ArgumentTypeError, "list"),
    (lambda: hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0])),
     psrt.ProcessSetError, "not registered"),
    (lambda: hvd.allreduce(torch.ones(2), process_set=[0]), psrt.ArgumentTypeError, "ProcessSet"),
    (lambda: hvd.synchronize(12345), psrt.InvalidArgumentError, "unknown"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_process_set_registration_and_errors():
    single = hvd.add_process_set([0])
    assert single.included() and single.rank() == 0 and single.size() == 1
    assert torch.equal(hvd.allreduce(torch.ones(2), process_set=single), torch.ones(2))
    with pytest.raises(psrt.ProcessSetError, match="outside the world"):
        hvd.add_process_set([0, 3])
    with pytest.raises(psrt.InvalidArgumentError, match="duplicates"):
        hvd.ProcessSet([0, 0])
    hvd.remove_process_set(single)
    with pytest.raises(psrt.ProcessSetError, match="not registered"):
        hvd.allreduce(torch.ones(2), process_set=single)
    with pytest.raises(psrt.ProcessSetError, match="cannot be removed"):
        hvd.remove_process_set(hvd.global_process_set)


def test_parameter_server_api_outside_ps_mode():
    import psrt.ps as ps
    assert (ps.num_servers(), ps.num_workers(), ps.worker_rank(), ps.role()) == (0, 1, 0, "worker")
    with pytest.raises(psrt.InvalidArgumentError, match="--num-servers"):
        ps.KVStore("sync")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(psrt.InvalidArgumentError, match="--num-servers"):
        ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(psrt.ArgumentTypeError, match="torch.optim.Optimizer"):
        ps.DistributedOptimizer(model)


def test_a_single_rank_job_cannot_be_all_servers(monkeypatch):
    hvd.shutdown()
    monkeypatch.setenv("PSRT_NUM_SERVERS", "1")
    with pytest.raises(psrt.InvalidArgumentError, match="at least one server and one worker"):
        hvd.init()


def test_a_process_no_launcher_started_opens_no_tcp_listener():
    """A singleton talks to nobody: Open MPI's TCP transport must not listen on every
    address (the settings must be in place before mpi4py is first imported)."""
    script = (
        "import os, psrt.torch as hvd, torch\n"
        "hvd.init(); hvd.allreduce(torch.ones(1))\n"
        "mine = {os.readlink(f'/proc/self/fd/{fd}') for fd in os.listdir('/proc/self/fd')\n"
        "        if os.path.exists(f'/proc/self/fd/{fd}')}\n"
        "rows = [line.split() for table in ('/proc/net/tcp', '/proc/net/tcp6') if os.path.exists(table)\n"
        "        for line in open(table).readlines()[1:]]\n"
        "print([row[1] for row in rows if row[3] == '0A' and f'socket:[{row[9]}]' in mine])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_the_singletons_transport_settings_do_not_leak_to_programs_it_starts():
    """A process that imported psrt and then launches a real job (psrun, a test harness)
    must not hand its children a transport that cannot reach other ranks."""
    assert "OMPI_MCA_btl" not in os.environ or os.environ["OMPI_MCA_btl"] != "self"
