"""Hierarchical allreduce against a single-process reference, in one 4-rank job.

Run as ``PSRT_HIERARCHICAL_ALLREDUCE=1 psrun -np 4 python hierarchical_check.py``.
The job runs on one host, where the setting must leave allreduces flat; the
hierarchical communicator itself is checked on made-up hosts (the world split
into groups of 2+2 and 1+3 ranks), with a tiny ring threshold so that both MPI's
algorithms and psrt's ring carry each step.  Rank 0 prints one JSON line per
check (see ``_harness``); the real multi-host run is in ``tests/multihost``.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

import psrt.runtime
import psrt.torch as hvd
from psrt.comm import ElementwiseOp
from psrt.comm.hierarchical import HierarchicalCommunicator, hierarchical_or_none
from psrt.comm.mpi import MpiCommunicator
from psrt.config import Config

import _harness
from _reference import DTYPES, check_reduced, samples

# Messages of at least 4 KiB take the ring (1,003 float32 elements and more), in 512-byte segments.
CONFIG = Config(ring_threshold=4096, ring_segment=512)
LAYOUTS = {"2+2": (2, 2), "1+3": (1, 3)}
SIZES = (1, 13, 1003, 5001)
_OPS = {"Sum": ElementwiseOp.SUM, "Average": ElementwiseOp.SUM, "Min": ElementwiseOp.MIN, "Max": ElementwiseOp.MAX,
        "Product": ElementwiseOp.PRODUCT}


def made_up_hosts(world: MpiCommunicator, sizes: tuple[int, ...]) -> HierarchicalCommunicator | None:
    """Treat consecutive world ranks as hosts of ``sizes`` ranks."""
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]
    host = max(i for i, first in enumerate(firsts) if first <= world.rank)
    local = world.split(host, key=world.rank)
    try:
        return hierarchical_or_none(world, local)
    finally:
        local.free()


def matches_single_process(key: str, world: MpiCommunicator, layout: str, dtype_name: str, op: str) -> None:
    comm = made_up_hosts(world, LAYOUTS[layout])
    assert isinstance(comm, HierarchicalCommunicator), f"{key}: got {comm!r} for hosts of {layout} ranks"
    try:
        for numel in SIZES:
            what = f"{key}/{numel}"
            inputs = samples(what, world.size, DTYPES[dtype_name], (numel,), op=op)
            mine = inputs[world.rank].clone()
            comm.allreduce(mine, _OPS[op], 1.0 / world.size if op == "Average" else 1.0)
            check_reduced(mine, inputs, op, what)
        assert comm.allreduces == len(SIZES), f"{key}: {comm.allreduces} hierarchical allreduces counted"
    finally:
        comm.free()


def other_collectives_go_flat(key: str, world: MpiCommunicator) -> None:
    comm = made_up_hosts(world, LAYOUTS["2+2"])
    try:
        value = torch.full((3,), float(world.rank))
        comm.broadcast(value, 3).wait()
        assert value.tolist() == [3.0] * 3, f"{key}: broadcast from world rank 3 gave {value.tolist()}"
        assert (comm.rank, comm.size) == (world.rank, world.size)
        assert comm.allreduces == 0
    finally:
        comm.free()


def no_gain_without_several_hosts_of_several_ranks(key: str, world: MpiCommunicator) -> None:
    for sizes in ((4,), (1, 1, 1, 1)):
        assert made_up_hosts(world, sizes) is None, f"{key}: hosts of {sizes} ranks got a hierarchical communicator"


def one_host_stays_flat(key: str) -> None:
    topology = psrt.runtime.current().topology
    assert psrt.runtime.current().config.hierarchical_allreduce, f"{key}: bad test, the setting is off"
    transport = topology.transport(psrt.runtime.global_process_set, torch.device("cpu"))
    assert transport is topology.world, f"{key}: one host got {type(transport).__name__}"
    inputs = samples(key, hvd.size(), torch.float32, (64,))
    got = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, name=key)
    check_reduced(got, inputs, "Sum", key)


def main() -> None:
    hvd.init()
    world = MpiCommunicator(MPI.COMM_WORLD.Dup(), CONFIG)  # apart from the engine's communicators
    checks = _harness.Checks()
    for layout in LAYOUTS:
        for dtype_name in ("float32", "float64", "float16", "bfloat16", "int32"):
            for op in ("Sum", "Average", "Min", "Max", "Product"):
                if op == "Average" and not DTYPES[dtype_name].is_floating_point:
                    continue  # integers are divided above the transport
                checks.add(f"hierarchical/{layout}/{dtype_name}/{op}", matches_single_process, world, layout,
                           dtype_name, op)
    checks.add("hierarchical/other_collectives_go_flat", other_collectives_go_flat, world)
    checks.add("hierarchical/no_gain_without_several_hosts_of_several_ranks",
               no_gain_without_several_hosts_of_several_ranks, world)
    checks.add("hierarchical/one_host_stays_flat", one_host_stays_flat)
    _harness.run(checks)
    world.free()
    hvd.shutdown()


if __name__ == "__main__":
    main()
