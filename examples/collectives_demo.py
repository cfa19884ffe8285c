"""Demo: every core collective across the ranks of a job, and what each rank got.

Run with ``psrun -np 2 python examples/collectives_demo.py`` (or ``make demo``).
"""
from __future__ import annotations

import torch

import psrt.torch as hvd


def show(label: str, value: object) -> None:
    """Print one line per rank, in rank order."""
    for rank in range(hvd.size()):
        if rank == hvd.rank():
            print(f"[rank {rank}] {label:<28} {value}", flush=True)
        hvd.barrier()


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        print(f"psrt demo: {size} ranks, {hvd.cross_size()} host(s), "
              f"{hvd.local_size()} rank(s) on this host", flush=True)
    hvd.barrier()

    mine = torch.arange(4, dtype=torch.float32) + 10 * rank
    show("input", mine.tolist())
    show("allreduce (Average)", hvd.allreduce(mine).tolist())
    show("allreduce (Sum)", hvd.allreduce(mine, op=hvd.Sum).tolist())
    show("allreduce (Max)", hvd.allreduce(mine, op=hvd.Max).tolist())
    show("allreduce bf16 (Sum)", hvd.allreduce(mine.bfloat16(), op=hvd.Sum).tolist())
    show("allgather (rank+1 rows)", hvd.allgather(torch.full((rank + 1,), rank)).tolist())
    show("broadcast from rank 0", hvd.broadcast(mine, root_rank=0).tolist())

    splits = [1 + (rank + dest) % 2 for dest in range(size)]
    rows = torch.arange(sum(splits)) + 100 * rank
    received, received_splits = hvd.alltoall(rows, splits=splits)
    show("alltoall sent splits", splits)
    show("alltoall received", f"{received.tolist()} splits {received_splits.tolist()}")
    show("reducescatter (Sum)", hvd.reducescatter(torch.ones(size * 2 + 1), op=hvd.Sum).tolist())

    handle = hvd.allreduce_async(torch.full((3,), float(rank)), op=hvd.Sum, name="async.demo")
    show("allreduce_async -> sync", hvd.synchronize(handle).tolist())

    evens = hvd.add_process_set(list(range(0, size, 2)))
    if evens.included():
        total = hvd.allreduce(torch.tensor([rank]), op=hvd.Sum, process_set=evens)
        print(f"[rank {rank}] {'even-rank process set sum':<28} {total.item()}", flush=True)
    hvd.barrier()
    if rank == 0:
        print("psrt demo: all collectives completed", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
