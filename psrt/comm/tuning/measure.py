"""Measuring a job's tuning table (:mod:`psrt.comm.tuning.table`), and finding or writing its file,
at ``psrt.init()``.

A job with no table for its key (hosts, CPU, MPI library, ranks, ranks per host) measures
one once, collectively: at a few sizes, each algorithm in turn (the order rotating, so that
drifts of a shared machine hit all alike), a barrier before each call, the slowest rank's
time of each call; a few repeats at large sizes, many at small ones.  Rank 0 chooses the bands
(another algorithm than MPI's own only where it clearly won, see
:func:`psrt.comm.tuning.table.choose_bands`), writes the file and shares the table, so that
every rank picks the same algorithm for every size.  A job
that finds its table reads it: one small message at start-up.  ``PSRT_TUNE=off`` keeps the
fixed threshold, ``PSRT_TUNE=measure`` measures again and replaces the file.

The first job measures within :data:`FIRST_JOB_BUDGET_S`, so that training starts soon
whatever the load (4 ranks on a busy 2-core machine took 9.7 s to measure every size): the
sizes go smallest first, the largest take the most time, and a size that would not fit, or
that the budget cuts short, is left unmeasured; above the sizes measured the table is the
fixed threshold's (:func:`psrt.comm.tuning.table.beyond_measured`).  Every rank stops at the
same point, as it sees every rank's clock (:func:`_agreed`), so all hold the same table.  A
size measured has had at least the repeats a choice needs, and more where there was time.
``PSRT_TUNE=measure`` and ``psrt tune`` measure every size.
"""
from __future__ import annotations

import datetime
import logging
import math
import platform
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from statistics import median
from typing import Optional

import torch

from psrt.comm.base import Communicator, ElementwiseOp
from psrt.comm.hierarchical import HierarchicalCommunicator
from psrt.comm.mpi import MpiCommunicator, library_version
from psrt.comm.tuning.table import (MARGIN, WIN_REPEATS, TuningFileError, TuningKey, TuningTable, beyond_measured,
                                    choose_bands, clearly_beats, default_path, medians, ratios, read, write)
from psrt.config import Config

logger = logging.getLogger("psrt")

_KiB, _MiB = 1 << 10, 1 << 20
#: Below the smallest, MPI's own algorithms win on latency (a ring step per rank costs more).
SIZES = (256 * _KiB, 1 * _MiB, 4 * _MiB, 16 * _MiB, 64 * _MiB)
#: Repeats at every size, and more (up to MAX_REPEATS) until BUDGET_S seconds have passed at
#: the size: on a shared 2-core VM, 5 repeats at 1 MiB chose the ring, which then lost to MPI
#: in the same job, while a large size's 3 repeats cost more than 30 of a small one's.
REPEATS = 3
MAX_REPEATS = 35
BUDGET_S = 0.03
#: Repeats an algorithm that looks faster than MPI's gets, past the budget: a win is taken from
#: no fewer (see clearly_beats).
CONFIRM_REPEATS = WIN_REPEATS
#: An algorithm this much faster than MPI's (clearly, see clearly_beats) at one size is taken to
#: stay ahead at larger ones, which are not measured.
DECISIVE = 0.5
#: Seconds the first job of a key spends measuring, at most (give or take one repeat at the
#: size where it runs out): half for the allreduce, the rest for the reduce-scatter.
FIRST_JOB_BUDGET_S = 1.5

#: One collective at one size by one algorithm: given a float32 buffer of the size, runs it.
Run = Callable[[torch.Tensor], None]
Samples = dict[int, dict[str, list[float]]]  # size -> algorithm -> seconds of each call


def cpu_model() -> str:
    """The CPU's model name (what decides a shared-memory allreduce's speed), as Linux names it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def job_key(world: Communicator, local: Communicator) -> TuningKey:
    """The key of this job's table; collective over ``world``."""
    mine = (socket.gethostname(), cpu_model(), local.size if local.rank == 0 else None)
    everyone = world.allgather_object(mine)
    return TuningKey(hosts=tuple(sorted({host for host, _, _ in everyone})),
                     cpu=" | ".join(sorted({cpu for _, cpu, _ in everyone})), mpi=library_version(),
                     ranks=world.size, ranks_per_host=tuple(sorted(n for _, _, n in everyone if n is not None)))


def time_runs(world: Communicator, runs: Mapping[str, Run], sizes: Sequence[int] = SIZES,
              repeats: int = REPEATS, max_repeats: int = MAX_REPEATS, budget_s: float = BUDGET_S,
              clock: Callable[[], float] = time.perf_counter, deadline: float = math.inf
              ) -> tuple[Samples, Optional[int]]:
    """Seconds of each of ``runs`` (algorithm -> run) at each size, the slowest rank's per
    call, and the first size left unmeasured at ``deadline`` (on ``clock``; None if none was);
    collective over ``world`` (every rank passes the same algorithms and sizes).

    A repeat runs each algorithm once, the first rotating.  Each size gets at least
    ``repeats`` repeats, then more until ``budget_s`` seconds have passed there (or
    ``max_repeats``): the small sizes, where noise decides most choices and a call takes
    microseconds, get many, the large ones, whose calls take milliseconds each, few; an
    algorithm that looks faster than MPI's gets at least :data:`CONFIRM_REPEATS`.  Sizes
    above one where an algorithm took at most :data:`DECISIVE` of MPI's time (clearly, see
    :func:`~psrt.comm.tuning.table.clearly_beats`) are not measured (they would take most of
    the time): a ring's advantage over MPI only grows with the size, as its cost is the bytes
    it moves and MPI's adds temporaries.  Nor are a size whose least work (:func:`_least_cost`)
    would end past ``deadline`` and those above: a size stops repeating where another repeat
    would end past ``deadline`` (as long as the last one took), and is left out if it has not
    had the repeats a choice needs by then."""
    names = list(runs)
    samples: Samples = {}
    for size in sizes:
        if _agreed(world, clock() + _least_cost(samples, size, repeats) > deadline)[0]:
            return samples, size
        buffer = torch.zeros(max(1, size // 4))  # zeros: sums never overflow, however many repeats
        began = clock()
        for name in names:  # one untimed call each: first-touch of buffers, MPI's set-up
            runs[name](buffer)
        mine: dict[str, list[float]] = {name: [] for name in names}
        start, repeat, last = clock(), 0, clock() - began  # last: the time of a repeat, as last seen
        while True:
            now = clock()
            spent, promising, late = _agreed(world, now - start >= budget_s, _promising(mine), now + last > deadline)
            if _enough(repeat, repeats, max_repeats, spent or late, promising):
                break
            if late:  # short of the repeats a choice needs
                return samples, size
            began = clock()
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                world.barrier().wait()
                called = clock()
                runs[name](buffer)
                mine[name].append(clock() - called)
            repeat, last = repeat + 1, clock() - began
        everyone = world.allgather_object(mine)  # the same on every rank, so is what follows
        samples[size] = {name: [max(theirs[name][i] for theirs in everyone) for i in range(repeat)]
                         for name in names}
        if "mpi" in names and any(median(r) <= DECISIVE and clearly_beats(r)
                                  for name, r in ratios({size: samples[size]})[size].items() if name != "mpi"):
            break
    return samples, None


def _least_cost(samples: Samples, size: int, repeats: int) -> float:
    """The seconds ``size`` takes at least (a warm-up call and ``repeats`` repeats of every
    algorithm), foreseen from the largest size measured so far, as a call's time grows with
    its bytes; 0 before any."""
    if not samples:
        return 0.0
    last = max(samples)
    return (repeats + 1) * sum(median(times) for times in samples[last].values()) * size / last


def _promising(mine: Mapping[str, Sequence[float]]) -> bool:
    """Whether this rank's calls so far show another algorithm beating MPI's by the margin."""
    if "mpi" not in mine or not mine["mpi"]:
        return False
    return any(median(r) <= 1 - MARGIN for name, r in ratios({0: mine})[0].items() if name != "mpi")


def _agreed(world: Communicator, *flags: bool) -> tuple[bool, ...]:
    """Each of ``flags``, true where it is true on any rank: decisions taken from every rank's
    view alike (each rank's clock differs a little), so that all run the same repeats and stop
    at the same size."""
    values = torch.tensor([float(flag) for flag in flags])
    world.allreduce(values, ElementwiseOp.MAX)
    return tuple(bool(value) for value in values)


def _enough(repeat: int, repeats: int, max_repeats: int, spent: bool, promising: bool) -> bool:
    """Whether to stop repeating at a size: past ``repeats`` and the time budget (``spent``),
    unless another algorithm looks faster and has had fewer than :data:`CONFIRM_REPEATS`
    (MPI's own is replaced only on that many); or at ``max_repeats``."""
    return repeat >= max_repeats or (repeat >= repeats and spent and not (promising and repeat < CONFIRM_REPEATS))


def allreduce_runs(world: MpiCommunicator) -> dict[str, Run]:
    return {algorithm: (lambda t, a=algorithm: world.allreduce_by(a, t, ElementwiseOp.SUM))
            for algorithm in ("mpi", "ring")}


def reduce_scatter_runs(world: MpiCommunicator) -> dict[str, Run]:
    outputs: dict[int, tuple[list[int], torch.Tensor]] = {}  # by input size, made before the timed calls

    def run(algorithm: str, send: torch.Tensor) -> None:
        if send.numel() not in outputs:
            base, extra = divmod(send.numel(), world.size)
            counts = [base + (rank < extra) for rank in range(world.size)]
            outputs[send.numel()] = counts, torch.empty(counts[world.rank])
        counts, recv = outputs[send.numel()]
        world.reduce_scatter_by(algorithm, send, recv, counts, ElementwiseOp.SUM).wait()
    return {algorithm: (lambda t, a=algorithm: run(a, t)) for algorithm in ("mpi", "ring")}


def measure_table(world: MpiCommunicator, hierarchical: Optional[HierarchicalCommunicator], key: TuningKey,
                  sizes: Sequence[int] = SIZES, *, budget_s: float = math.inf,
                  ring_threshold: int = Config.ring_threshold, clock: Callable[[], float] = time.perf_counter
                  ) -> TuningTable:
    """Measure and choose this job's table (collective over ``world``); every rank returns
    rank 0's.  With ``hierarchical`` (a job over several hosts), its three steps are measured
    against the flat algorithms too.  Within ``budget_s`` seconds (half of them for the
    allreduce), sizes left unmeasured go by the fixed ``ring_threshold`` (see
    :func:`~psrt.comm.tuning.table.beyond_measured`)."""
    start = clock()
    flat = allreduce_runs(world)
    runs = dict(flat, hierarchical=hierarchical.allreduce_hierarchically) if hierarchical is not None else flat
    allreduce, allreduce_left = time_runs(world, runs, sizes, clock=clock, deadline=start + budget_s / 2)
    reduce_scatter, reduce_scatter_left = time_runs(world, reduce_scatter_runs(world), sizes, clock=clock,
                                                    deadline=start + budget_s)
    table = None
    if world.rank == 0:
        costs = ratios(allreduce)
        flat_only = {size: {a: cost[a] for a in flat} for size, cost in costs.items()}
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        left = [f"{name} from {size} bytes" for name, size in (("allreduce", allreduce_left),
                                                                ("reduce_scatter", reduce_scatter_left)) if size]
        table = TuningTable(
            key, beyond_measured(choose_bands(flat_only), allreduce_left, ring_threshold),
            beyond_measured(choose_bands(ratios(reduce_scatter)), reduce_scatter_left, ring_threshold),
            choose_bands(costs) if hierarchical is not None else (),  # its last band goes on above
            measured=f"{when}, in {clock() - start:.2f} s" + (
                f"; not measured within {budget_s:g} s: {', '.join(left)} (there the fixed threshold, "
                f"{ring_threshold} bytes; psrt tune measures every size)" if left else ""),
            measurements={"allreduce": _rows(allreduce), "reduce_scatter": _rows(reduce_scatter)})
    return world.allgather_object(table)[0]


def _rows(samples: Samples) -> list[dict]:
    """What a table's file shows of its measurements: per size, the repeats, each algorithm's
    median microseconds, its median time relative to MPI's and in how many repeats it was
    faster (what the bands were chosen by)."""
    times, costs = medians(samples), ratios(samples)
    return [{"bytes": size, "repeats": len(samples[size]["mpi"]),
             **{f"{name}_us": round(value * 1e6, 1) for name, value in times[size].items()},
             **{key: value for name, r in costs[size].items() if name != "mpi"
                for key, value in ((f"{name}_over_mpi", round(median(r), 3)),
                                   (f"{name}_faster", sum(x < 1.0 for x in r)))}}
            for size in sorted(samples)]


def in_use(config: Config, world: Communicator) -> bool:
    """Whether a job over ``world`` follows a measured table (else the fixed threshold)."""
    return config.tune != "off" and world.size > 1


def establish(world: MpiCommunicator, local: Communicator, hierarchical: Optional[HierarchicalCommunicator],
              config: Config) -> TuningTable:
    """Put this job's table in force on ``world`` (and the communicators sharing its choice)
    and return it: read from its file, or measured and written there (see the module's
    docstring).  Collective over ``world``, before anything else uses it."""
    if not in_use(config, world):
        return world.choice.table
    key = job_key(world, local)
    path = default_path(key, config.tune_file)
    found = None
    if world.rank == 0 and config.tune == "auto" and path.exists():
        try:
            found = read(path, key)
        except TuningFileError as exc:
            logger.warning("psrt: %s; measuring this job's table instead (PSRT_TUNE=off: fixed thresholds)", exc)
    table = world.allgather_object(found)[0]  # rank 0's: every rank then measures, or none does
    if table is None:
        budget = FIRST_JOB_BUDGET_S if config.tune == "auto" else math.inf  # "measure": every size
        table = measure_table(world, hierarchical, key, budget_s=budget, ring_threshold=config.ring_threshold)
        if world.rank == 0:
            _save(path, table)
    world.choice.use(table)
    return table


def _save(path, table: TuningTable) -> None:
    try:
        write(path, table)
    except OSError as exc:
        logger.warning("psrt: could not write the tuning table to %s (%s); the next job will measure again",
                       path, exc.strerror or exc)
        return
    logger.warning("psrt: measured which allreduce algorithm to use at each size (%s) and wrote %s; later "
                   "jobs of this machine, MPI and layout read it (PSRT_TUNE=measure measures again)",
                   table.measured.split(", in ")[-1], path)
