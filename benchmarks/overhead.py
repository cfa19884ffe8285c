"""Overhead benchmark: what psrt's own machinery costs, against raw mpi4py and gloo.

Run under a launcher (2 ranks)::

    psrun -np 2 python benchmarks/overhead.py [--reps 7] [--iters 200]

Three measurements, each comparing implementations in the same run, taking turns
in repetitions (a repetition is a block of iterations, each after a barrier; its
figure is the median over iterations of the slowest rank's time), reporting the
median over repetitions:

* **blocking allreduce** of a float32 tensor whose name repeats (``hvd.allreduce_``:
  the response cache applies) against mpi4py's in-place ``Allreduce`` on a numpy
  buffer and gloo's ``all_reduce``, 8 B to 16 MiB; and against the *floor* of any
  negotiated call: the same ``Allreduce`` preceded by one persistent 3-byte MIN
  allreduce, as psrt's round is (what agreeing by name costs with no Python at all);
* **a burst of async allreduces**: 64 tensors of 16 KiB submitted with
  ``allreduce_async_`` then synchronised, against 64 separate mpi4py calls and one
  fused mpi4py call of the same bytes (how a Horovod ``DistributedOptimizer`` step
  without buckets looks);
* **an idle engine**: the process's CPU time over a few seconds of ``time.sleep`` after
  ``hvd.init()``, as a share of one core.

Rank 0 prints a table and one JSON line per measurement; the issue's targets are
reported (met or missed), never asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

import psrt.torch as hvd

from _gloo import init_gloo  # noqa: E402
from _sizes import KiB, MiB, fmt_size  # noqa: E402
from mpi4py import MPI  # after hvd: psrt's bootstrap initialises MPI  # noqa: E402

comm = MPI.COMM_WORLD
SIZES = [8, 4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB]
# psrt/mpi4py ratio targets of issue 14 (blocking allreduce), by size
TARGETS = {8: 0.25, 4 * KiB: 0.25, 64 * KiB: 0.5, 1 * MiB: 0.9, 4 * MiB: 1.0, 16 * MiB: 1.0}
BURST_TENSORS, BURST_BYTES = 64, 16 * KiB


def timed_block(run: Callable[[], None], iters: int) -> float:
    """Median over ``iters`` of the slowest rank's time of one ``run()``."""
    times = []
    for _ in range(iters):
        comm.Barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    slowest = np.empty(iters)
    comm.Allreduce(np.array(times), slowest, MPI.MAX)
    return float(np.median(slowest))


def compare(impls: dict[str, Callable[[], None]], reps: int, iters: int) -> dict[str, float]:
    """Median over ``reps`` alternating repetitions of each implementation's block median."""
    for run in impls.values():  # warm-up: caches, first-call set-up
        timed_block(run, 3)
    figures: dict[str, list[float]] = {name: [] for name in impls}
    for _ in range(reps):
        for name, run in impls.items():
            figures[name].append(timed_block(run, iters))
    return {name: statistics.median(values) for name, values in figures.items()}


def blocking(reps: int, iters: int) -> list[dict]:
    rows = []
    vote = np.ones(3, dtype=np.uint8)
    negotiation = comm.Allreduce_init(MPI.IN_PLACE, vote, MPI.MIN)
    for nbytes in SIZES:
        n = max(1, nbytes // 4)
        tensor, array, gloo = torch.ones(n), np.ones(n, dtype=np.float32), torch.ones(n)
        name = f"overhead.{nbytes}"
        count = max(5, min(iters, (256 * MiB) // max(nbytes, 1) // reps))

        def floor(array: np.ndarray = array) -> None:
            negotiation.Start()
            negotiation.Wait()
            comm.Allreduce(MPI.IN_PLACE, array, MPI.SUM)

        t = compare({"psrt": lambda: hvd.allreduce_(tensor, name=name, op=hvd.Sum),
                     "mpi4py": lambda: comm.Allreduce(MPI.IN_PLACE, array, MPI.SUM),
                     "floor": floor, "gloo": lambda: dist.all_reduce(gloo)}, reps, count)
        rows.append({"bytes": nbytes, "psrt_us": t["psrt"] * 1e6, "mpi4py_us": t["mpi4py"] * 1e6,
                     "floor_us": t["floor"] * 1e6, "gloo_us": t["gloo"] * 1e6,
                     "psrt/mpi4py": t["mpi4py"] / t["psrt"], "floor/mpi4py": t["mpi4py"] / t["floor"],
                     "gloo/psrt": t["gloo"] / t["psrt"], "target": TARGETS[nbytes]})
    negotiation.Free()
    return rows


def burst(reps: int, iters: int) -> dict:
    n = BURST_BYTES // 4
    tensors = [torch.ones(n) for _ in range(BURST_TENSORS)]
    arrays = [np.ones(n, dtype=np.float32) for _ in range(BURST_TENSORS)]
    fused = np.ones(n * BURST_TENSORS, dtype=np.float32)

    submitting: list[float] = []  # this rank's time to submit the 64 (no waiting in it)

    def psrt() -> None:
        start = time.perf_counter()
        handles = [hvd.allreduce_async_(t, name=f"burst.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        submitting.append(time.perf_counter() - start)
        for handle in handles:
            hvd.synchronize(handle)

    def separate() -> None:
        for array in arrays:
            comm.Allreduce(MPI.IN_PLACE, array, MPI.SUM)

    t = compare({"psrt": psrt, "mpi4py separate": separate,
                 "mpi4py fused": lambda: comm.Allreduce(MPI.IN_PLACE, fused, MPI.SUM)}, reps, iters)
    return {"tensors": BURST_TENSORS, "bytes_each": BURST_BYTES, "psrt_us": t["psrt"] * 1e6,
            "psrt_submitting_us": statistics.median(submitting) * 1e6,
            "separate_us": t["mpi4py separate"] * 1e6, "fused_us": t["mpi4py fused"] * 1e6,
            "fused/psrt": t["mpi4py fused"] / t["psrt"], "target": 0.8}


def idle(seconds: float) -> dict:
    """CPU share of one core this process uses while psrt is idle (every rank sleeps)."""
    comm.Barrier()
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    shares = comm.gather(share)
    return {"seconds": seconds, "cpu_share_max": max(shares) if shares else share, "target": 0.01}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="alternating repetitions (default 7)")
    parser.add_argument("--iters", type=int, default=200, help="iterations per repetition, at most")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    args = parser.parse_args()
    hvd.init()
    init_gloo(comm)
    idle_row = idle(args.idle_seconds)  # first: nothing has run yet that could still be busy
    rows = blocking(args.reps, args.iters)
    burst_row = burst(args.reps, max(5, args.iters // 4))
    idle_after = idle(args.idle_seconds)  # again, after traffic: the engine must fall quiet
    if hvd.rank() == 0:
        print(f"# psrt overhead benchmark: {hvd.size()} ranks, {args.reps} alternating repetitions, "
              f"median of medians (time = slowest rank)")
        print("## blocking allreduce (float32, Sum, named)")
        print("| size | psrt µs | mpi4py µs | floor µs | gloo µs | psrt/mpi4py | target | floor/mpi4py | gloo/psrt |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            met = "met" if r["psrt/mpi4py"] >= r["target"] else "missed"
            print(f"| {fmt_size(r['bytes'])} | {r['psrt_us']:.1f} | {r['mpi4py_us']:.1f} | {r['floor_us']:.1f} | "
                  f"{r['gloo_us']:.1f} | {r['psrt/mpi4py']:.3f} | ≥ {r['target']} ({met}) | "
                  f"{r['floor/mpi4py']:.3f} | {r['gloo/psrt']:.1f} |")
        b = burst_row
        print(f"## {b['tensors']} async allreduces of {fmt_size(b['bytes_each'])}, then synchronize")
        print(f"psrt {b['psrt_us']:.0f} µs (of which submitting {b['psrt_submitting_us']:.0f} µs), 64 mpi4py "
              f"calls {b['separate_us']:.0f} µs, one fused mpi4py call {b['fused_us']:.0f} µs: fused/psrt "
              f"{b['fused/psrt']:.3f} (target ≥ 0.8)")
        print(f"## idle: {100 * idle_row['cpu_share_max']:.2f} % of a core before traffic, "
              f"{100 * idle_after['cpu_share_max']:.2f} % after (target < 1 %)")
        print(json.dumps({"benchmark": "overhead", "ranks": hvd.size(), "blocking": rows, "burst": burst_row,
                          "idle_before": idle_row, "idle_after": idle_after}))
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
