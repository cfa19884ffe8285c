"""Transport-level checks run inside one job: point-to-point messages, splits,
agreement, and the ring allreduce against a numpy reference.

Uses the same harness as the collective checks: rank 0 prints one JSON line
per check, then ``{"done": N}``.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

import psrt
from psrt import runtime
from psrt.comm import ElementwiseOp
from psrt.comm.base import Communicator
from psrt.comm.mpi import MpiCommunicator
from psrt.config import Config
from _harness import Checks, run

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    values = torch.randint(-50, 50, (numel,), generator=generator)
    return values.to(dtype)


@check
def blocking_send_recv_around_the_ring(world):
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    out = torch.full((5, 3), float(world.rank))
    got = torch.empty(5, 3)
    if world.rank % 2 == 0:
        world.send(out, right, tag=7)
        world.recv(got, left, tag=7)
    else:
        world.recv(got, left, tag=7)
        world.send(out, right, tag=7)
    assert torch.equal(got, torch.full((5, 3), float(left))), got


@check
def nonblocking_send_recv_of_every_dtype(world):
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    for tag, dtype in enumerate([torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                 torch.int8, torch.uint8, torch.int16, torch.int32,
                                 torch.int64, torch.bool]):
        payload = inputs(world.rank, 33, torch.float64).to(dtype)
        expected = inputs(left, 33, torch.float64).to(dtype)
        received = torch.empty(33, dtype=dtype)
        recv = world.irecv(received, left, tag=tag)
        send = world.isend(payload, right, tag=tag)
        while not recv.test():
            pass
        send.wait()
        assert torch.equal(received, expected), (dtype, received, expected)


@check
def persistent_receive_takes_each_message_in_turn(world):
    """A persistent receive, started again after each message, takes a stream of messages
    into one buffer in the order they were sent, over MPI and through the base class's
    fallback (a receive posted per start), as the parameter server's header loop uses it."""
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    for tag, persistent in ((40, world.persistent_recv), (41, lambda *args: Communicator.persistent_recv(world, *args))):
        buffer = torch.empty(4, dtype=torch.int64)
        receive = persistent(buffer, left, tag)
        sends = [world.isend(torch.full((4,), 100 * world.rank + i, dtype=torch.int64), right, tag) for i in range(6)]
        for i in range(6):
            receive.start().wait()
            assert buffer.tolist() == [100 * left + i] * 4, (tag, i, buffer.tolist())
        receive.free()
        for send in sends:
            send.wait()


@check
def split_gives_each_color_its_own_group(world):
    sub = world.split(world.rank % 2, key=world.rank)
    members = [r for r in range(world.size) if r % 2 == world.rank % 2]
    assert sub.size == len(members) and sub.rank == members.index(world.rank)
    value = torch.tensor([float(world.rank)])
    sub.allreduce(value, ElementwiseOp.SUM)
    assert value.item() == float(sum(members))
    none = world.split(None if world.rank == 0 else 1)
    assert (none is None) == (world.rank == 0)
    for comm in (sub, none):
        if comm is not None:
            comm.free()


@check
def ring_allreduce_matches_numpy_for_odd_sizes_and_all_ops(world):
    _allreduce_matches_numpy(world, Config(ring_threshold=1, ring_segment=64))  # the ring, many segments


@check
def segmented_allreduce_matches_numpy_for_odd_sizes_and_all_ops(world):
    """Below the ring threshold, scaled messages over two segments go to MPI a segment at a
    time (integers, which take no scale, go whole)."""
    _allreduce_matches_numpy(world, Config(ring_threshold=1 << 30, ring_segment=64), scale=0.5)


def _allreduce_matches_numpy(world, config: Config, scale: float = 1.0) -> None:
    comm = MpiCommunicator(MPI.COMM_WORLD, config)
    references = {ElementwiseOp.SUM: np.sum, ElementwiseOp.MIN: np.min, ElementwiseOp.MAX: np.max,
                  ElementwiseOp.PRODUCT: np.prod}
    for numel in (1, world.size - 1, 53, 1001):
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16):
            for op, reference in references.items():
                if op is ElementwiseOp.PRODUCT:
                    mine = inputs(world.rank, numel, dtype).clamp(-2, 2)
                    every = np.stack([inputs(r, numel, dtype).clamp(-2, 2).numpy()
                                      for r in range(world.size)])
                else:
                    mine = inputs(world.rank, numel, dtype)
                    every = np.stack([inputs(r, numel, dtype).numpy()
                                      for r in range(world.size)])
                factor = scale if dtype.is_floating_point else 1.0
                comm.allreduce(mine, op, scale=factor)
                expected = reference(every, axis=0) * factor
                assert np.allclose(mine.numpy(), expected, rtol=1e-6), (numel, dtype, op)
    scaled = inputs(world.rank, 101, torch.float64)
    comm.allreduce(scaled, ElementwiseOp.SUM, scale=0.5)
    expected = sum(inputs(r, 101, torch.float64) for r in range(world.size)) * 0.5
    assert torch.allclose(scaled, expected)
    comm.free()


@check
def ring_reduce_scatter_leaves_each_rank_its_block_and_keeps_the_input(world):
    comm = MpiCommunicator(MPI.COMM_WORLD, Config(ring_threshold=1, ring_segment=64))
    for counts in ([3] * world.size, [world.size - r for r in range(world.size)],
                   [0] * (world.size - 1) + [5]):
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            mine = inputs(world.rank, sum(counts), dtype)
            before = mine.clone()
            received = torch.empty(counts[world.rank], dtype=dtype)
            comm.reduce_scatter(mine, received, counts, ElementwiseOp.SUM).wait()
            total = sum(inputs(r, sum(counts), torch.float64) for r in range(world.size))
            start = sum(counts[:world.rank])
            expected = total[start:start + counts[world.rank]].to(dtype)
            assert torch.equal(received, expected), (counts, dtype, received, expected)
            assert torch.equal(mine, before), "the input was modified"
    comm.free()


def main() -> None:
    psrt.init()
    world = runtime.current().topology.world
    checks = Checks()
    for fn in CHECKS:
        checks.add(fn.__name__, lambda name, fn=fn: fn(world))
    run(checks)
    psrt.shutdown()


if __name__ == "__main__":
    main()
