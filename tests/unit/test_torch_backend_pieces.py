"""The torch.distributed backend's pieces in one process: how torch's reductions map onto
psrt's, when psrt's env:// start-up takes over from torch's, and a one-rank job on it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import psrt.torch  # noqa: F401  (registers the backend)
from psrt.comm.base import ElementwiseOp
from psrt.errors import InvalidArgumentError, UnsupportedOperationError
from psrt.torch.c10d import rendezvous
from psrt.torch.c10d.group import reduction

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("op,expected", [(dist.ReduceOp.SUM, (ElementwiseOp.SUM, 1.0)),
                                         (dist.ReduceOp.MIN, (ElementwiseOp.MIN, 1.0)),
                                         (dist.ReduceOp.MAX, (ElementwiseOp.MAX, 1.0)),
                                         (dist.ReduceOp.PRODUCT, (ElementwiseOp.PRODUCT, 1.0)),
                                         (dist.ReduceOp.AVG, (ElementwiseOp.SUM, 0.25))])
def test_torch_reductions_map_to_a_psrt_reduction_and_a_scale(op, expected):
    assert reduction(dist.ReduceOp(op), 4, torch.float32) == expected


def test_a_bare_reduction_type_maps_too():
    """``dist.ReduceOp.SUM`` itself (a ``RedOpType``), as a direct call of the group's
    methods without options passes it."""
    assert reduction(dist.ReduceOp.SUM, 2, torch.float32) == (ElementwiseOp.SUM, 1.0)
    assert reduction(dist.ReduceOp.MAX, 2, torch.float32) == (ElementwiseOp.MAX, 1.0)
    assert reduction(dist.ReduceOp.AVG, 2, torch.float32) == (ElementwiseOp.SUM, 0.5)


def test_a_premultiplied_sum_is_a_sum_scaled_by_its_factor():
    assert reduction(dist._make_nccl_premul_sum(0.125), 4, torch.bfloat16) == (ElementwiseOp.SUM, 0.125)


def test_an_integer_average_and_bitwise_reductions_are_refused_by_name():
    with pytest.raises(InvalidArgumentError, match="AVG of a torch.int64 tensor"):
        reduction(dist.ReduceOp(dist.ReduceOp.AVG), 2, torch.int64)
    with pytest.raises(UnsupportedOperationError, match="no BXOR reduction"):
        reduction(dist.ReduceOp(dist.ReduceOp.BXOR), 2, torch.int32)


def test_the_env_handler_leaves_a_process_no_mpi_launcher_started_to_torch(monkeypatch):
    """torchrun's processes (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, no MPI
    launcher's variables, psrt not running): torch's own handler runs.  Under an MPI launcher
    psrt's runs whatever is set (Lightning's check in tests/parallel/scripts/torch_backend_check.py)."""
    seen = []

    def torch_env(url, **kwargs):
        seen.append(url)
        yield "store", 3, 4

    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD"):
        monkeypatch.delenv(name, raising=False)
    assert next(rendezvous._from_mpi(torch_env)("env://")) == ("store", 3, 4)
    assert seen == ["env://"]


def test_init_process_group_psrt_runs_a_one_rank_job_without_variables():
    """After psrt.init(), in a process no launcher started: a rank or size other than MPI's is
    refused by name; then rank 0 of 1, a collective and DDP.  Its store listens on loopback
    alone, and a process that connects to it neither reads nor overwrites the job's keys."""
    script = """
import datetime, os, torch, torch.distributed as dist
import psrt.torch as hvd
from launcher.listeners import listening
hvd.init()
for kwargs, env in (({"rank": 0, "world_size": 2}, {}), ({}, {"RANK": "1"})):
    os.environ.update(env)
    try:
        dist.init_process_group("psrt", **kwargs)
    except ValueError as exc:  # psrt's InvalidArgumentError
        print("refused:", exc)
    for name in env:
        del os.environ[name]
os.environ["MASTER_ADDR"] = "127.0.0.1"  # one variable of four: psrt's start-up still takes over
dist.init_process_group("psrt")
(store_socket,) = listening([os.getpid()])
store = dist.distributed_c10d._get_default_store()
store.set("probe", "job")
foreign = dist.TCPStore("127.0.0.1", store_socket.port, is_master=False, timeout=datetime.timedelta(seconds=30))
foreign.set("probe", "forged")
print("store on", store_socket.address, store.get("probe").decode(), foreign.get("probe").decode())
t = torch.ones(3)
dist.all_reduce(t, op=dist.ReduceOp.AVG)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
model(torch.ones(1, 2)).sum().backward()
print(dist.get_backend(), dist.get_rank(), dist.get_world_size(), t.tolist())
dist.destroy_process_group()
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == ("refused: init_process_group was given world_size=2 but MPI says 1 on this process "
                        "(under mpirun, leave world_size out)"), done.stdout
    assert lines[1] == ("refused: init_process_group was given RANK=1 in the environment but MPI says 0 on this "
                        "process (under mpirun, leave rank out)"), done.stdout
    assert lines[2] == "store on 127.0.0.1 job forged", done.stdout
    assert lines[-1] == "psrt 0 1 [1.0, 1.0, 1.0]", done.stdout


@pytest.mark.parametrize("master_addr,one_host,resolved,expected", [
    ("10.0.0.5", False, "10.0.0.7", ("10.0.0.5", "10.0.0.5")),
    (None, True, "10.0.0.7", ("127.0.0.1", "127.0.0.1")),
    (None, False, "10.0.0.7", ("10.0.0.7", "10.0.0.7")),
    (None, False, "127.0.1.1", ("", "node7")),  # Debian's /etc/hosts: every address, by name
    (None, False, None, ("", "node7")),
])
def test_the_store_listens_where_the_ranks_connect(monkeypatch, master_addr, one_host, resolved, expected):
    """(where rank 0's store listens, what the others connect to)"""
    if master_addr is None:
        monkeypatch.delenv("MASTER_ADDR", raising=False)
    else:
        monkeypatch.setenv("MASTER_ADDR", master_addr)
    monkeypatch.setattr(rendezvous.socket, "gethostname", lambda: "node7")

    def resolve(name):
        if resolved is None:
            raise OSError("unknown host")
        return resolved

    monkeypatch.setattr(rendezvous.socket, "gethostbyname", resolve)
    assert rendezvous._address(one_host=one_host) == expected
