"""Hierarchical vs flat allreduce across two "hosts" of two ranks each.

Run as a plain script (as root on Linux: it builds the multi-host test bed of
``tests/multihost/netns.py``, network namespaces joined by a bridge, and skips
saying why where it cannot)::

    python benchmarks/hierarchical.py [--sizes 64K,1M,16M,64M] [--repeats 5] [--mpi-args ARGS]

One job of 4 ranks runs with ``PSRT_HIERARCHICAL_ALLREDUCE=1``, so that
``hvd.allreduce_`` (op Average, float32) on the global set goes hierarchically
(reduce on the host, allreduce between the two hosts' leaders, broadcast on the
host) while the same call on a registered process set of all four ranks stays
flat: psrt's default path, MPI's allreduce below ``PSRT_RING_THRESHOLD`` (16 MiB)
and psrt's ring from there.  Both go through the same engine in the same
processes.  For each size the two take turns, the first one alternating; a turn
is a few back-to-back calls after a barrier, timed as the mean per call and the
max over ranks; the figure is the median over the repetitions.  Rank 0 reports,
and this script prints a table and a JSON line.  The ratio hierarchical / flat is
the figure that matters (below 1: hierarchical is faster).  All "hosts" share this
machine's cores and memory, and the "network" is TCP over veth pairs and a
bridge: the ratio says what the step structure costs or saves here, not what a
real interconnect would give.

Each "host" claims 2 slots, so Open MPI does not know that its 4 ranks share 2
cores and lets every waiting rank spin; by default the job runs with
``--mca mpi_yield_when_idle 1`` (what Open MPI does itself when it knows it is
oversubscribed), since spinning ranks steal the cores of the ranks they wait for
and the figures then measure the scheduler more than the allreduce
(``--mpi-args ""`` shows that).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "multihost")]

import torch  # noqa: E402

from _sizes import MiB, fmt_size, parse_size  # noqa: E402

if TYPE_CHECKING:
    from psrt.topology import ProcessSet

PATHS = ("flat", "hierarchical")
JOB_TIMEOUT_S = 590.0


# -- inside the job (every rank; psrt is imported here only, since importing it starts MPI) ----
def calls_per_turn(nbytes: int) -> int:
    """About 32 MiB per turn, between 2 and 50 calls."""
    return max(2, min(50, (32 * MiB) // nbytes))


def timed_turn(tensor: torch.Tensor, process_set: ProcessSet, name: str, calls: int) -> float:
    """Seconds per call, the max over ranks."""
    import psrt.torch as hvd

    hvd.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        hvd.allreduce_(tensor, op=hvd.Average, name=name, process_set=process_set)
    mine = torch.tensor([(time.perf_counter() - start) / calls], dtype=torch.float64)
    return hvd.allreduce(mine, op=hvd.Max, name="bench.turn").item()


def run_job(sizes: list[int], repeats: int) -> None:
    import psrt.runtime
    import psrt.torch as hvd

    hvd.init()
    torch.set_num_threads(1)
    sets = {"flat": hvd.add_process_set(list(range(hvd.size()))), "hierarchical": hvd.global_process_set}
    transport = psrt.runtime.current().topology.transport(hvd.global_process_set, torch.device("cpu"))
    seconds: dict[str, dict[str, list[float]]] = {}
    for nbytes in sizes:
        tensor, calls = torch.ones(nbytes // 4), calls_per_turn(nbytes)
        for path in PATHS:  # warm-up: caches, buffers, connections
            timed_turn(tensor, sets[path], f"{path}.{nbytes}", 2)
        turns: dict[str, list[float]] = {path: [] for path in PATHS}
        for repeat in range(repeats):
            for path in (PATHS if repeat % 2 == 0 else PATHS[::-1]):
                turns[path].append(timed_turn(tensor, sets[path], f"{path}.{nbytes}", calls))
        seconds[fmt_size(nbytes)] = turns
    if hvd.rank() == 0:
        print(json.dumps({"job": {"transport": type(transport).__name__, "hosts": hvd.cross_size(),
                                  "local_size": hvd.local_size(), "seconds": seconds}}), flush=True)
    hvd.shutdown()


# -- outside the job --------------------------------------------------------------------------
def launch(sizes: str, repeats: int, mpi_args: str) -> dict | None:
    """Rank 0's report from the job on a two-host test bed (None where the bed cannot be made)."""
    import netns

    reason = netns.skip_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return None
    with tempfile.TemporaryDirectory(prefix="psrt-hierarchical-") as workdir:
        bed = netns.Testbed(f"psrt-h-{os.getpid()}-", 2, Path(workdir))
        try:
            bed.build()
            job = bed.psrun("--mpi-args=" + mpi_args, "-np", "4", sys.executable, str(Path(__file__).resolve()),
                            "--job", "--sizes", sizes, "--repeats", str(repeats), slots=2,
                            env={"PSRT_HIERARCHICAL_ALLREDUCE": "1"})
            code = job.finish(JOB_TIMEOUT_S)
        except netns.SetupRefused as e:
            print(f"skipped: {e}")
            return None
        finally:
            bed.destroy()
    if code != 0:
        raise RuntimeError(f"the benchmark job failed\n{job.diagnosis()}")
    return next(json.loads(line)["job"] for line in job.out.splitlines() if line.startswith('{"job"'))


def summarize(report: dict, repeats: int, mpi_args: str) -> None:
    if report["transport"] != "HierarchicalCommunicator":
        raise RuntimeError(f"the global set's transport is {report['transport']}: the job did not go hierarchical")
    print(f"allreduce_ (Average, float32), {report['hosts']} hosts x {report['local_size']} ranks (network "
          f"namespaces on one machine), median of {repeats} alternating turns, max over ranks; extra mpirun arguments: "
          f"{mpi_args or 'none'}")
    print(f"{'size':>6} {'flat ms':>9} {'hierarchical ms':>16} {'hier/flat':>10} {'turn by turn':>13}")
    rows = {}
    for size, turns in report["seconds"].items():
        flat, hierarchical = (statistics.median(turns[path]) * 1e3 for path in PATHS)
        # each repetition's two turns ran back to back: their ratio shows the spread
        paired = [h / f for f, h in zip(turns["flat"], turns["hierarchical"])]
        rows[size] = {"flat_ms": round(flat, 3), "hierarchical_ms": round(hierarchical, 3),
                      "ratio": round(hierarchical / flat, 3),
                      "turn_ratio_range": [round(min(paired), 3), round(max(paired), 3)]}
        spread = f"{min(paired):.2f}-{max(paired):.2f}"
        print(f"{size:>6} {flat:>9.2f} {hierarchical:>16.2f} {hierarchical / flat:>10.2f} {spread:>13}")
    print(json.dumps({"benchmark": "hierarchical_allreduce", "hosts": report["hosts"],
                      "ranks_per_host": report["local_size"], "repeats": repeats, "mpi_args": mpi_args, "sizes": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,1M,16M,64M", help="comma-separated message sizes")
    parser.add_argument("--repeats", type=int, default=5, help="turns of each path per size (at least 5)")
    parser.add_argument("--mpi-args", default="--mca mpi_yield_when_idle 1",
                        help="extra mpirun arguments for the job (default: %(default)s)")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # a rank of the job
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5")
    if args.job:
        run_job([parse_size(s) for s in args.sizes.split(",")], args.repeats)
        return
    report = launch(args.sizes, args.repeats, args.mpi_args)
    if report is not None:
        summarize(report, args.repeats, args.mpi_args)


if __name__ == "__main__":
    main()
