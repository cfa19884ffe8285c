"""Collectives benchmark: psrt vs raw mpi4py vs torch.distributed (gloo), same run.

Run under a launcher (2 ranks, or 4 with ``--oversubscribe`` on a 2-core box)::

    python -m launcher.cli -np 2 python benchmarks/collectives.py
    mpirun --allow-run-as-root --bind-to none -x OMPI_MCA_btl=^ofi -x OMPI_MCA_mtl=^ofi \
        -np 2 python benchmarks/collectives.py [--max-size 16M] [--iters 20]
    ... python benchmarks/collectives.py --sweep-threshold      # ring vs MPI crossover
    ... python benchmarks/collectives.py --tuned                # psrt tuned vs this MPI, 8 B .. 64 MiB

For allreduce, allgather, reducescatter and broadcast (float32, op Sum) and each
message size, the implementations take turns in short blocks (several rounds
per size), each timed iteration after a barrier; an iteration's time is the max
over ranks (the collective is done when the slowest rank is) and the figure
reported is the median over iterations.  psrt is called through its public API
(``allreduce_``, ``allgather``, ``reducescatter``, ``broadcast_``: outputs of
allgather and reducescatter are allocated by psrt on every call, as the API
requires), plus its transport directly for allreduce; mpi4py works on numpy
buffers allocated once, gloo on torch tensors allocated once.  Bandwidths follow NCCL-tests: algbw = bytes / time,
busbw = algbw x 2(n-1)/n (allreduce), x (n-1)/n (allgather, reducescatter;
bytes = the full gathered / reduced buffer), x 1 (broadcast).  Rank 0 prints a
table per collective, one JSON line per (collective, size), and a summary JSON
line with the targets; targets are reported, never asserted.  With allreduce among the
collectives, rank 0 also draws benchmarks/plots/allreduce_busbw.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

import psrt.torch as hvd
from psrt import runtime
from psrt.comm import ElementwiseOp
from psrt.comm.ring import ring_allreduce

from _gloo import init_gloo  # noqa: E402
import _plots  # noqa: E402
import _tuned  # noqa: E402
from _sizes import KiB, MiB, fmt_size, parse_size  # noqa: E402
from mpi4py import MPI  # after hvd: psrt's bootstrap initialises MPI  # noqa: E402

DEFAULT_SIZES = [4 * KiB * 4 ** k for k in range(9)]            # 4 KiB .. 256 MiB
SWEEP_SIZES = [64 * KiB * 2 ** k for k in range(11)]            # 64 KiB .. 64 MiB
SWEEP_SEGMENTS = [256 * KiB, 1 * MiB, 4 * MiB]
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast")
RING_MEMORY_PASSES = 3.5   # bytes through memory per rank, in units of the message (2-rank ring)

comm = MPI.COMM_WORLD


# -- helpers ---------------------------------------------------------------------
def default_iters(nbytes: int) -> int:
    """About 2 GiB per implementation per size, between 6 and 200 iterations."""
    return max(6, min(200, (2 << 30) // nbytes))


def say(*args: object) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


@dataclass
class Impl:
    """One implementation of a collective at one size: fill inputs, run once, check output."""
    name: str
    run: Callable[[], object]
    fill: Callable[[], None]
    check: Callable[[object], bool]


def warmup_calls(nbytes: int) -> int:
    """Untimed calls before each block: enough to outlast what the previous block left running."""
    return max(1, min(20, 4 * MiB // nbytes))


def time_interleaved(impls: list[Impl], iters: int, warmup: int) -> dict[str, list[float]]:
    """Per implementation, per iteration: seconds of the slowest rank (barrier before each).

    The implementations take turns in up to 10 rounds of short blocks (A A A, B B B, C C C,
    A A A...), each block after ``warmup`` untimed calls: drifts (this box switches between
    fast and slow phases lasting seconds) hit all alike, and no timed call directly follows
    another implementation (gloo's threads keep a 2-core box busy after a call returns).
    """
    for impl in impls:  # one checked call each
        impl.fill()
        comm.Barrier()
        if not impl.check(impl.run()):
            raise RuntimeError(f"{impl.name} returned a wrong result on rank {comm.rank}")
    rounds = max(1, min(10, iters // 4))
    blocks = [len(part) for part in np.array_split(np.arange(iters), rounds)]
    mine = {impl.name: [] for impl in impls}
    for block in blocks:
        for impl in impls:
            for _ in range(warmup):
                impl.run()
            for _ in range(block):
                comm.Barrier()
                start = time.perf_counter()
                impl.run()
                mine[impl.name].append(time.perf_counter() - start)
    slowest = {}
    for impl in impls:
        times = np.array(mine[impl.name])
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        slowest[impl.name] = times.tolist()
    return slowest


# -- the implementations of each collective ------------------------------------------
def _filled(buf, value: float) -> Callable[[], None]:
    def fill() -> None:
        buf[:] = value
    return fill


def _all_equal(buf, want: float, then_zero: bool = False) -> Callable[[object], bool]:
    """Check ``buf`` (torch or numpy) holds ``want`` everywhere; optionally zero it after,
    so timed in-place sums never overflow."""
    def check(_: object) -> bool:
        ok = bool((buf == want).all())
        if then_zero:
            buf[:] = 0
        return ok
    return check


def allreduce_impls(nbytes: int) -> list[Impl]:
    n, count, me = comm.size, nbytes // 4, comm.rank + 1
    want = n * (n + 1) / 2
    world = runtime.current().topology.world
    psrt_t, transport_t, gloo_t = (torch.empty(count) for _ in range(3))
    mpi_a = np.empty(count, dtype=np.float32)
    return [Impl(name, run, _filled(buf, me), _all_equal(buf, want, then_zero=True))
            for name, buf, run in (
                ("psrt", psrt_t, lambda: hvd.allreduce_(psrt_t, op=hvd.Sum)),
                ("psrt_transport", transport_t,
                 lambda: world.allreduce(transport_t, ElementwiseOp.SUM)),
                ("mpi4py", mpi_a,
                 lambda: comm.Allreduce(MPI.IN_PLACE, [mpi_a, MPI.FLOAT], op=MPI.SUM)),
                ("gloo", gloo_t, lambda: dist.all_reduce(gloo_t, op=dist.ReduceOp.SUM)))]


def allgather_impls(nbytes: int) -> list[Impl]:
    """bytes = the gathered buffer; each rank contributes bytes / n (psrt allocates its output
    on every call, as hvd.allgather must; the baselines reuse one)."""
    n, part = comm.size, nbytes // 4 // comm.size
    expected = np.repeat(np.arange(n, dtype=np.float32), part)
    psrt_send, gloo_send = torch.full((part,), float(comm.rank)), torch.full((part,), float(comm.rank))
    gloo_out = torch.empty(part * n)
    mpi_send, mpi_out = np.full(part, comm.rank, dtype=np.float32), np.empty(part * n, np.float32)
    same = lambda out: bool(np.array_equal(np.asarray(out), expected))  # noqa: E731
    nothing = lambda: None  # noqa: E731
    return [
        Impl("psrt", lambda: hvd.allgather(psrt_send), nothing, same),
        Impl("mpi4py", lambda: comm.Allgather([mpi_send, MPI.FLOAT], [mpi_out, MPI.FLOAT])
             or mpi_out, nothing, same),
        Impl("gloo", lambda: dist.all_gather_single(gloo_out, gloo_send) or gloo_out,
             nothing, same),
    ]


def reducescatter_impls(nbytes: int) -> list[Impl]:
    """bytes = the buffer reduced; each rank keeps bytes / n (psrt allocates its output)."""
    n, count = comm.size, nbytes // 4
    want = n * (n + 1) / 2
    psrt_send, gloo_send = (torch.full((count,), float(comm.rank + 1)) for _ in range(2))
    gloo_out = torch.empty(count // n)
    mpi_send, mpi_out = np.full(count, comm.rank + 1, np.float32), np.empty(count // n, np.float32)
    ok = lambda out: len(out) == count // n and bool((out == want).all())  # noqa: E731
    nothing = lambda: None  # noqa: E731
    return [
        Impl("psrt", lambda: hvd.reducescatter(psrt_send, op=hvd.Sum), nothing, ok),
        Impl("mpi4py", lambda: comm.Reduce_scatter_block([mpi_send, MPI.FLOAT], [mpi_out, MPI.FLOAT],
                                                         op=MPI.SUM) or mpi_out, nothing, ok),
        Impl("gloo", lambda: dist.reduce_scatter_single(gloo_out, gloo_send) or gloo_out,
             nothing, ok),
    ]


def broadcast_impls(nbytes: int) -> list[Impl]:
    count = nbytes // 4
    psrt_t, gloo_t = torch.empty(count), torch.empty(count)
    mpi_a = np.empty(count, dtype=np.float32)
    return [Impl(name, run, _filled(buf, comm.rank + 7), _all_equal(buf, 7))
            for name, buf, run in (
                ("psrt", psrt_t, lambda: hvd.broadcast_(psrt_t, root_rank=0)),
                ("mpi4py", mpi_a, lambda: comm.Bcast([mpi_a, MPI.FLOAT], root=0)),
                ("gloo", gloo_t, lambda: dist.broadcast(gloo_t, src=0)))]


IMPLS = {"allreduce": allreduce_impls, "allgather": allgather_impls,
         "reducescatter": reducescatter_impls, "broadcast": broadcast_impls}


def bus_factor(collective: str, n: int) -> float:
    return {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n,
            "reducescatter": (n - 1) / n, "broadcast": 1.0}[collective]


# -- memory-copy bandwidth ---------------------------------------------------------
def memcpy_bandwidth(nbytes: int = 256 * MiB, iters: int = 10) -> dict[str, float]:
    """np.copyto bandwidth (bytes copied / s, median): rank 0 alone, and all ranks at once."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)

    def timed() -> float:
        start = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - start

    alone, together = [], []
    for _ in range(iters):
        comm.Barrier()
        if comm.rank == 0:
            alone.append(timed())
        comm.Barrier()
        together.append(comm.allreduce(timed(), op=MPI.MAX))
    alone_s = comm.bcast(statistics.median(alone) if comm.rank == 0 else None)
    return {"memcpy_GBps_one_rank": nbytes / alone_s / 1e9,
            "memcpy_GBps_all_ranks": nbytes / statistics.median(together) / 1e9}


# -- main benchmark -------------------------------------------------------------------
def tiny_allreduce_us(iters: int = 2000) -> float:
    """Latency of the 2 x int64 MPI allreduce psrt's agreement check adds to each call."""
    probe = np.zeros(2, dtype=np.int64)
    times = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, probe, op=MPI.MIN)
        times[i] = time.perf_counter() - start
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return float(np.median(times)) * 1e6


def benchmark(args: argparse.Namespace) -> None:
    n = comm.size
    memcpy = memcpy_bandwidth()
    ceiling = memcpy["memcpy_GBps_all_ranks"] / RING_MEMORY_PASSES
    say(f"# memcpy (np.copyto, 256 MiB): {memcpy['memcpy_GBps_one_rank']:.2f} GB/s one rank alone, "
        f"{memcpy['memcpy_GBps_all_ranks']:.2f} GB/s per rank with all {n} ranks copying")
    if n == 2:
        say(f"# 2-rank ring ceiling busbw ~ {ceiling:.2f} GB/s (all-ranks memcpy / "
            f"{RING_MEMORY_PASSES}); /ceil = psrt allreduce busbw / that")
    records = []
    for collective in args.collectives:
        names = [impl.name for impl in IMPLS[collective](4 * n)]
        say(f"\n## {collective} ({n} ranks, float32, Sum; busbw in GB/s, time = median of max "
            "over ranks)")
        header = f"{'size':>6} {'iters':>5} " + " ".join(
            f"{nm + ' us':>12} {'busbw':>6}" for nm in names) + f" {'/mpi4py':>7} {'/gloo':>6}"
        if collective == "allreduce":
            header += "  api_us" + ("  /ceil" if n == 2 else "")
        say(header)
        for nbytes in args.sizes:
            iters = args.iters or default_iters(nbytes)
            impls = IMPLS[collective](nbytes)
            times = time_interleaved(impls, iters, warmup_calls(nbytes))
            del impls
            record = result_record(collective, nbytes, iters, times, ceiling)
            records.append(record)
            say(table_row(record, names))
            say(json.dumps(record))
    summary = summarize(records, memcpy, ceiling)
    summary["agreement_allreduce_us"] = round(tiny_allreduce_us(), 2)
    say("\n" + targets_text(summary))
    say(json.dumps(summary))
    allreduce = [r for r in records if r["collective"] == "allreduce"]
    if allreduce and comm.rank == 0:
        names = ("psrt", "psrt_transport", "mpi4py", "gloo")
        say("# plot:", _plots.allreduce_busbw([r["bytes"] for r in allreduce],
                                              {nm: [r[nm]["busbw_GBps"] for r in allreduce] for nm in names},
                                              n, ceiling if n == 2 else None,
                                              "hvd.allreduce_ is called without a name, so every call is negotiated "
                                              "afresh (no response cache, no express path): overhead.py times named "
                                              "calls"))


def result_record(collective: str, nbytes: int, iters: int, times: dict[str, list[float]],
                  ceiling: float) -> dict:
    n = comm.size
    record: dict = {"bench": "collectives", "collective": collective, "bytes": nbytes,
                    "ranks": n, "iters": iters}
    for name, samples in times.items():
        t = statistics.median(samples)
        algbw = nbytes / t / 1e9
        record[name] = {"time_us": round(t * 1e6, 2), "algbw_GBps": round(algbw, 4),
                        "busbw_GBps": round(algbw * bus_factor(collective, n), 4)}
    bus = {name: record[name]["busbw_GBps"] for name in times}
    record["psrt_over_mpi4py"] = round(bus["psrt"] / bus["mpi4py"], 3)
    record["psrt_over_gloo"] = round(bus["psrt"] / bus["gloo"], 3)
    if "psrt_transport" in times:
        record["transport_over_mpi4py"] = round(bus["psrt_transport"] / bus["mpi4py"], 3)
        record["api_overhead_us"] = round(record["psrt"]["time_us"]
                                          - record["psrt_transport"]["time_us"], 2)
        if n == 2:
            record["psrt_over_ceiling"] = round(bus["psrt"] / ceiling, 3)
    return record


def table_row(record: dict, names: list[str]) -> str:
    row = f"{fmt_size(record['bytes']):>6} {record['iters']:>5} " + " ".join(
        f"{record[nm]['time_us']:>12.1f} {record[nm]['busbw_GBps']:>6.2f}" for nm in names)
    row += f" {record['psrt_over_mpi4py']:>7.2f} {record['psrt_over_gloo']:>6.2f}"
    if "api_overhead_us" in record:
        row += f" {record['api_overhead_us']:>7.1f}"
        row += f" {record['psrt_over_ceiling']:>5.2f}" if "psrt_over_ceiling" in record else ""
    return row


def summarize(records: list[dict], memcpy: dict, ceiling: float) -> dict:
    """The targets: psrt allreduce busbw >= 1.0x mpi4py from 64 KiB, >= 1.5x from 64 MiB,
    >= 2x gloo at every size."""
    allreduce = [r for r in records if r["collective"] == "allreduce"]
    checks = []
    for r in allreduce:
        size = fmt_size(r["bytes"])
        if r["bytes"] >= 64 * KiB:
            checks.append((f"psrt/mpi4py >= 1.0 at {size}", r["psrt_over_mpi4py"], 1.0))
        if r["bytes"] >= 64 * MiB:
            checks.append((f"psrt/mpi4py >= 1.5 at {size}", r["psrt_over_mpi4py"], 1.5))
        checks.append((f"psrt/gloo >= 2.0 at {size}", r["psrt_over_gloo"], 2.0))
    small = [r["api_overhead_us"] for r in allreduce if r["bytes"] <= 64 * KiB]
    return {
        "bench": "collectives_summary", "ranks": comm.size, **memcpy,
        "ring_ceiling_busbw_GBps": round(ceiling, 3) if comm.size == 2 else None,
        "ring_memory_passes": RING_MEMORY_PASSES,
        "ratios": {f"{r['collective']}/{fmt_size(r['bytes'])}":
                   {"psrt_over_mpi4py": r["psrt_over_mpi4py"], "psrt_over_gloo": r["psrt_over_gloo"]}
                   for r in records},
        "psrt_over_ceiling": {fmt_size(r["bytes"]): r["psrt_over_ceiling"] for r in allreduce
                              if "psrt_over_ceiling" in r and r["bytes"] >= 1 * MiB},
        "api_overhead_us_small": round(statistics.median(small), 2) if small else None,
        "targets": [{"target": name, "value": value, "met": value >= bound}
                    for name, value, bound in checks],
        "all_targets_met": all(value >= bound for _, value, bound in checks),
    }


def targets_text(summary: dict) -> str:
    lines = ["## targets (psrt allreduce busbw ratios)"]
    lines += [f"  {'MET   ' if t['met'] else 'MISSED'} {t['target']}: {t['value']:.2f}"
              for t in summary["targets"]]
    met = sum(t["met"] for t in summary["targets"])
    lines.append(f"  {met}/{len(summary['targets'])} targets met")
    if summary["api_overhead_us_small"] is not None:
        lines.append(f"  psrt API overhead (psrt - transport time, median over sizes <= 64K): "
                     f"{summary['api_overhead_us_small']:.1f} us; its 2 x int64 agreement "
                     f"allreduce alone (raw MPI): {summary['agreement_allreduce_us']:.1f} us")
    if summary["psrt_over_ceiling"]:
        lines.append("  psrt allreduce busbw / memcpy ceiling: " + ", ".join(
            f"{k} {v:.2f}" for k, v in summary["psrt_over_ceiling"].items()))
    return "\n".join(lines)


# -- threshold sweep --------------------------------------------------------------------
def sweep_threshold(args: argparse.Namespace) -> None:
    """MPI's own allreduce vs psrt's ring on numpy, per size and ring segment; prints the crossover."""
    ring_comm = comm.Dup()
    add = lambda mine, incoming, out: np.add(mine, incoming, out=out)  # noqa: E731
    segments = args.segments
    say(f"## threshold sweep ({comm.size} ranks, float32 Sum, in place; time = median of max "
        "over ranks, us)")
    say(f"{'size':>6} {'iters':>5} {'mpi':>10} " + " ".join(
        f"{'ring/' + fmt_size(s):>11}" for s in segments) + "  best ring/mpi speed-up")
    wins: dict[int, list[bool]] = {s: [] for s in segments}
    rows = []
    for nbytes in args.sizes:
        iters = args.iters or default_iters(nbytes)
        arrays = {name: np.zeros(nbytes // 4, dtype=np.float32)
                  for name in ["mpi", *map(str, segments)]}
        impls = [Impl("mpi", lambda a=arrays["mpi"]: comm.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT],
                                                                    op=MPI.SUM),
                      lambda: None, lambda _: True)]
        for s in segments:
            impls.append(Impl(str(s), lambda a=arrays[str(s)], s=s: ring_allreduce(
                ring_comm, a, s // 4, add), lambda: None, lambda _: True))
        times = {k: statistics.median(v) * 1e6
                 for k, v in time_interleaved(impls, iters, warmup_calls(nbytes)).items()}
        best = min(segments, key=lambda s: times[str(s)])
        for s in segments:
            wins[s].append(times[str(s)] < times["mpi"])
        row = {"bench": "ring_threshold", "bytes": nbytes, "iters": iters,
               "mpi_us": round(times["mpi"], 1),
               "ring_us": {fmt_size(s): round(times[str(s)], 1) for s in segments},
               "best_segment": fmt_size(best),
               "best_ring_speedup": round(times["mpi"] / times[str(best)], 3)}
        rows.append(row)
        say(f"{fmt_size(nbytes):>6} {iters:>5} {times['mpi']:>10.1f} " + " ".join(
            f"{times[str(s)]:>11.1f}" for s in segments)
            + f"  {fmt_size(best):>4} {row['best_ring_speedup']:.2f}x")
        say(json.dumps(row))
    crossover = {fmt_size(s): _crossover(args.sizes, w) for s, w in wins.items()}
    any_best = [r["best_ring_speedup"] > 1.0 for r in rows]
    summary = {"bench": "ring_threshold_summary", "ranks": comm.size,
               "crossover_by_segment": crossover,
               "crossover_best_segment": _crossover(args.sizes, any_best)}
    say("crossover (smallest size from which the ring wins at every larger size): " + ", ".join(
        f"segment {k}: {fmt_size(v) if v else 'never'}" for k, v in crossover.items())
        + "; best segment at each size: " + (fmt_size(summary["crossover_best_segment"])
                                               if summary["crossover_best_segment"] else "never"))
    say(json.dumps(summary))
    ring_comm.Free()


def _crossover(sizes: list[int], wins: list[bool]) -> int | None:
    """Smallest size from which every larger size is a win, or None."""
    result = None
    for nbytes, won in reversed(list(zip(sizes, wins))):
        if not won:
            break
        result = nbytes
    return result


# -- entry point -----------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   help="comma-separated message sizes, e.g. 4K,1M,64M")
    p.add_argument("--max-size", type=parse_size, help="drop sizes above this, e.g. 16M")
    p.add_argument("--iters", type=int, help="timed iterations per size (default: by size)")
    p.add_argument("--collectives", type=lambda s: s.split(","), default=list(COLLECTIVES),
                   help="comma-separated subset of " + ",".join(COLLECTIVES))
    p.add_argument("--sweep-threshold", action="store_true",
                   help="compare MPI's allreduce with psrt's ring instead (64 KiB .. 64 MiB)")
    p.add_argument("--tuned", action="store_true",
                   help="psrt's allreduce (as its tuning table chooses) against mpi4py's, 8 B .. 64 MiB, with the "
                        "algorithm chosen per size")
    p.add_argument("--segments", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=SWEEP_SEGMENTS, help="ring segment sizes for --sweep-threshold")
    args = p.parse_args(argv)
    if args.tuned:
        args.sizes = args.sizes or _tuned.SIZES
        return args
    args.sizes = args.sizes or (SWEEP_SIZES if args.sweep_threshold else DEFAULT_SIZES)
    if args.max_size:
        args.sizes = [s for s in args.sizes if s <= args.max_size]
    unknown = set(args.collectives) - set(COLLECTIVES)
    if unknown:
        p.error(f"unknown collectives {sorted(unknown)}; choose from {','.join(COLLECTIVES)}")
    bad = [s for s in args.sizes if s % (4 * comm.size)]
    if bad:
        p.error(f"sizes {bad} are not multiples of 4 bytes x {comm.size} ranks")
    return args


def main() -> None:
    hvd.init()
    args = parse_args()
    if comm.size < 2:
        sys.exit("run this under a launcher with at least 2 ranks, e.g. "
                 "python -m launcher.cli -np 2 python benchmarks/collectives.py")
    if args.tuned:
        _tuned.tuned_table(comm, say, time_interleaved, Impl, default_iters, warmup_calls, args.sizes, args.iters)
    elif args.sweep_threshold:
        sweep_threshold(args)
    else:
        init_gloo(comm)
        say(f"# psrt collectives benchmark: {comm.size} ranks, sizes "
            f"{','.join(map(fmt_size, args.sizes))}, pid {os.getpid()}")
        benchmark(args)
        dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
