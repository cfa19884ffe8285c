"""Two ranks on one GPU try an NCCL communicator directly (psrt itself stages such ranks
through host memory, psrt.comm.staged): NCCL normally refuses ("Duplicate GPU detected"),
but a build or a setting may allow it.  Rank 0 prints one JSON line with the outcome,
``refused`` (with NCCL's message), ``works`` (an allreduce gave the right sum) or ``wrong``
(it gave another)."""
from __future__ import annotations

import json

import torch

import psrt.runtime
import psrt.torch as hvd
from psrt.comm.base import ElementwiseOp
from psrt.comm.nccl import NcclCommunicator


def attempt(world) -> tuple[str, str]:
    try:
        comm = NcclCommunicator(world, torch.device("cuda", 0))
    except Exception as exc:  # NCCL's refusal is the expected outcome, recorded as such
        return "refused", f"{type(exc).__name__}: {exc}"
    tensor = torch.full((1024,), float(world.rank + 1), device="cuda:0")
    comm.allreduce(tensor, ElementwiseOp.SUM)
    torch.cuda.synchronize()
    want = world.size * (world.size + 1) / 2
    comm.free()
    if torch.equal(tensor.cpu(), torch.full((1024,), want)):
        return "works", f"allreduce over {world.size} ranks on cuda:0 gave {want:g}"
    return "wrong", f"allreduce gave {tensor[:4].tolist()}..., not {want:g}"


def main() -> None:
    hvd.init()
    torch.cuda.set_device(0)
    world = psrt.runtime.current().topology.world
    outcomes = world.allgather_object(attempt(world))
    if world.rank == 0:
        kinds = {kind for kind, _ in outcomes}
        outcome = kinds.pop() if len(kinds) == 1 else "wrong"
        print(json.dumps({"nccl_two_ranks_one_gpu": outcome, "ranks": [d for _, d in outcomes]}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
