"""Allreduces through ``hvd`` checked exactly against a reference every rank computes itself,
for a job started with ``PSRT_HIERARCHICAL_ALLREDUCE=1`` across hosts.

Run on every rank (``psrun -np 4 python hierarchical_job.py``). Inputs are small integers,
so every sum, product and power-of-two average is exact in every dtype whatever order
the ranks' values are added in: any difference is a wrong result, not rounding. Every
rank prints one JSON line: its host, the class of the communicator that carried the
global set's host tensors and how many allreduces it ran hierarchically, the one a
registered process set uses, and the checks that failed (none, when all is well).
"""
from __future__ import annotations

import json
import socket

import torch

import psrt.runtime
import psrt.torch as hvd

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32)
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max, "Product": hvd.Product}
# Under the job's PSRT_RING_THRESHOLD (64 KiB) the largest size takes psrt's ring in every step.
SIZES = (1, 1000, 100_003)


def values(rank: int, numel: int, op: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 10 + rank)
    if op == "Product":
        picked = torch.tensor([-2.0, -1.0, 1.0, 2.0])[torch.randint(0, 4, (numel,), generator=generator)]
    else:
        picked = torch.randint(-8, 9, (numel,), generator=generator).double()
    return picked.to(dtype)


def reference(inputs: list[torch.Tensor], op: str, dtype: torch.dtype) -> torch.Tensor:
    stacked = torch.stack([t.double() for t in inputs])
    if op in ("Sum", "Average"):
        result = stacked.sum(0)
        if op == "Average":  # integers are rounded toward zero, as Horovod does
            result = result / len(inputs) if dtype.is_floating_point else torch.trunc(result / len(inputs))
    else:
        result = {"Min": stacked.amin(0), "Max": stacked.amax(0), "Product": stacked.prod(0)}[op]
    return result.to(dtype)


def check_allreduces(size: int, rank: int) -> list[str]:
    failures, seed = [], 0
    for dtype in DTYPES:
        for op, hvd_op in OPS.items():
            for numel in SIZES:
                seed += 1
                inputs = [values(r, numel, op, dtype, seed) for r in range(size)]
                got = hvd.allreduce(inputs[rank], op=hvd_op, name=f"{dtype}.{op}.{numel}")
                if not torch.equal(got, reference(inputs, op, dtype)):
                    failures.append(f"{dtype} {op} of {numel} elements")
    # three tensors ready together travel as one fused message
    inputs = [[values(r, 777 + i, "Sum", torch.float32, 1000 + i) for i in range(3)] for r in range(size)]
    handles = [hvd.allreduce_async(t, op=hvd.Sum, name=f"fused.{i}") for i, t in enumerate(inputs[rank])]
    for i, handle in enumerate(handles):
        if not torch.equal(hvd.synchronize(handle), reference([mine[i] for mine in inputs], "Sum", torch.float32)):
            failures.append(f"fused tensor {i}")
    return failures


def main() -> None:
    hvd.init()
    torch.set_num_threads(1)
    subset = hvd.add_process_set([0, 1, 2, 3])
    failures = check_allreduces(hvd.size(), hvd.rank())
    topology = psrt.runtime.current().topology
    cpu = torch.device("cpu")
    transport = topology.transport(psrt.runtime.global_process_set, cpu)
    print(json.dumps({"rank": hvd.rank(), "host": socket.gethostname(), "transport": type(transport).__name__,
                      "hierarchical_allreduces": getattr(transport, "allreduces", 0),
                      "process_set_transport": type(topology.transport(subset, cpu)).__name__,
                      "failures": failures}), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
