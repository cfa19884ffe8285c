"""Two ranks sharing one GPU (the host-staged path): do the staged copies and the MPI exchange
overlap the backward kernels?  A profiler trace of rank 0's ``DistributedOptimizer`` steps says.

NCCL refuses two ranks on one device, so each collective's tensors are copied to pinned host
memory on psrt's communication stream, exchanged over MPI by the engine thread, and copied
back on that stream (``psrt/comm/staged.py``); meanwhile the training thread should go on
queueing backward kernels.  Run from the repository root on a machine with one GPU::

    psrun -np 2 python benchmarks/gpu_shared_trace.py --json-out summary.json --trace-out trace.json

Model: an MLP of ``--layers`` square ``--width``-wide layers, SGD, a ``--rows`` x width batch,
small first buckets so that gradients leave during backward.  After ``--warmup`` steps rank 0
profiles ``--steps`` steps (CUDA and CPU activity) and reports, from the Chrome trace: the
time of the copies on psrt's stream and of the collectives the engine ran (``psrt.<collective>``
ranges: the MPI exchange with its staging), and how much of each lies under a compute kernel on another stream.  Prints a
table and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import psrt.torch as hvd


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--trace-out", type=Path, default=Path("gpu-shared-trace.json"))
    return parser.parse_args(argv)


def _intervals(events: list[dict]) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _covered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Microseconds of ``intervals`` that lie under ``cover`` (a union)."""
    total = 0.0
    for start, end in intervals:
        for a, b in cover:
            total += max(0.0, min(end, b) - max(start, a))
    return total


def summarise(trace: dict) -> dict:
    """Copies on psrt's stream and host exchanges, and their overlap with compute kernels."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copy_streams = {e.get("args", {}).get("stream") for e in copies}
    compute = _union(_intervals([e for e in kernels if e.get("args", {}).get("stream") not in copy_streams]))
    exchanges = _intervals([e for e in events if e.get("cat") == "user_annotation"
                            and str(e.get("name", "")).startswith("psrt.")])
    copy_spans = _intervals(copies)
    ms = 1e-3
    return {"copies_ms": round(sum(b - a for a, b in copy_spans) * ms, 3),
            "copies_under_compute_ms": round(_covered(copy_spans, compute) * ms, 3),
            "exchanges_ms": round(sum(b - a for a, b in exchanges) * ms, 3),
            "exchanges_under_compute_ms": round(_covered(exchanges, compute) * ms, 3),
            "compute_kernels_ms": round(sum(b - a for a, b in compute) * ms, 3),
            "copy_streams": sorted(s for s in copy_streams if s is not None)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    layers = [m for _ in range(args.layers) for m in (torch.nn.Linear(args.width, args.width), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers).cuda()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                         named_parameters=model.named_parameters(),
                                         bucketing=hvd.Bucketing(first_bucket_bytes=1 << 20, bucket_bytes=8 << 20,
                                                                 overlap=True))
    x = torch.randn(args.rows, args.width, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    if hvd.rank() == 0:
        profiler.export_chrome_trace(str(args.trace_out))
        summary = {"ranks": hvd.size(), "gpu": torch.cuda.get_device_name(0), "layers": args.layers,
                   "width": args.width, "rows": args.rows, "steps": args.steps,
                   **summarise(json.loads(args.trace_out.read_text()))}
        for key, value in summary.items():
            print(f"{key:>28}: {value}")
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(summary) + "\n")
        print(json.dumps(summary))
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
