"""Expert-parallel benchmark: step time of one ``ep.MoE`` layer at EP = world size, the time
inside psrt's dispatch/combine all-to-alls and its share of the step, the load balance the
router produced, and psrt's all-to-all against raw mpi4py ``Alltoallv`` of the same sizes.

Run under a launcher (EP = the world size, which must divide ``--experts``)::

    psrun -np 2 python benchmarks/moe.py
    psrun -np 4 python benchmarks/moe.py --tokens 2048 --repeats 3

Every rank holds ``--tokens`` tokens of width ``--dim`` (its own random draw; the router and
experts come from one seed) and runs forward and backward of a dropless ``MoE(--dim,
--hidden, --experts, top_k=--top-k)`` over ``ProcessGrid(dp=n, ep=n).ep_set``, loss = mean
square of the output, no optimizer (so routing is the same every step).  The input requires
grad, as an activation inside a model does, so backward runs both reversed all-to-alls.
After ``--warmup`` untimed steps, each of ``--repeats`` rounds times one window of
``--steps`` steps after a barrier, taking the slowest rank; figures are medians over rounds.
``a2a ms`` = ``ep.stats().seconds`` per step (psrt's all-to-alls: forward's row-count exchange,
dispatch and combine, backward's two reversed ones; each includes any wait for a slower peer,
e.g. one whose experts got more rows), mean over ranks (min and
max in brackets); ``a2a share`` = a rank's a2a time / step time, mean over ranks.
Load balance: assignments (token, expert) per expert summed over ranks, max / mean (1 is
perfect).  Dropped: the assignments over capacity in one untimed forward of the same layer
(same weights) with ``--capacity-factor``, summed over ranks.
Baseline: the four data all-to-alls of a step (dispatch, combine, and the two of backward,
which have the same sizes reversed) with the row counts per destination exactly as this
run's routing produced them, each row ``--dim`` float32s: psrt's ``ep.comm.exchange`` with the
counts given (what the MoE's ``all_to_all`` runs: its one counts exchange per forward has
agreed on them already) in a tight loop, against mpi4py
``Alltoallv`` on numpy buffers over COMM_WORLD (EP = world) in the same order of ranks; the
two take turns, slowest rank per window, median.  ``in step / raw`` divides the in-step a2a
time (which also has the count exchange and the waits) by the raw loop's.
On this 2-core host -np 4 oversubscribes the cores: four busy ranks share two, so step
times double and every all-to-all also waits for descheduled peers, inflating its share.
Rank 0 prints a table and one JSON line.  Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import psrt.torch as hvd
from psrt import ep
from psrt.grid import ProcessGrid


def step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).pow(2).mean().backward()


def slowest(seconds: float) -> float:
    return float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="bench.moe.time"))


def window(args, model: torch.nn.Module, x: torch.Tensor) -> tuple[float, list[float], float, float]:
    """Slowest rank's seconds per step; every rank's a2a seconds per step; mean a2a share; a2a calls per step."""
    hvd.barrier()
    ep.stats().reset()
    start = time.perf_counter()
    for _ in range(args.steps):
        step(model, x)
    mine = (time.perf_counter() - start) / args.steps
    a2a = ep.stats().seconds / args.steps
    per_rank = hvd.allgather_object((a2a, a2a / mine), name="bench.moe.a2a")
    return (slowest(mine), [a for a, _ in per_rank], statistics.fmean(s for _, s in per_rank),
            ep.stats().counts["all_to_all"] / args.steps)


def routing(args, model: ep.MoE, x: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """Assignments per expert over all ranks, and rows[s][d] rank s sends rank d on dispatch."""
    with torch.no_grad():
        chosen = torch.softmax(model.router(x), dim=-1).topk(args.top_k, dim=-1).indices.reshape(-1)
    mine = torch.bincount(chosen, minlength=args.experts)
    everyone = hvd.allgather_object(mine.tolist(), name="bench.moe.routing")
    per_expert = [sum(column) for column in zip(*everyone)]
    local = args.experts // hvd.size()
    rows = [[sum(counts[d * local:(d + 1) * local]) for d in range(hvd.size())] for counts in everyone]
    return per_expert, rows


def alltoall_against_mpi4py(args, grid: ProcessGrid, rows: list[list[int]], calls: int = 20) -> dict:
    """A dropless step's four data all-to-alls (dispatch, combine sizes, twice): psrt's
    ``exchange`` against mpi4py ``Alltoallv``; seconds per step, slowest rank, median."""
    from mpi4py import MPI  # after hvd.init: psrt's bootstrap initialises MPI

    me, n = grid.ep_set.rank(), hvd.size()
    comm = MPI.COMM_WORLD.Split(0, key=me)
    send_rows, recv_rows = rows[me], [rows[s][me] for s in range(n)]
    shapes = [(send_rows, recv_rows), (recv_rows, send_rows)] * 2  # dispatch, combine; backward alike
    mine = [torch.randn(sum(s), args.dim) for s, _ in shapes]

    def counts_and_displacements(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        floats = np.array(counts) * args.dim
        return floats, np.concatenate([[0], np.cumsum(floats)[:-1]])

    theirs = [([tensor.numpy().copy(), counts_and_displacements(s), MPI.FLOAT],
               [np.empty(sum(r) * args.dim, np.float32), counts_and_displacements(r), MPI.FLOAT])
              for (s, r), tensor in zip(shapes, mine)]
    times = {"psrt": [], "mpi4py": []}
    for _ in range(args.repeats):
        for name, samples in times.items():
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                for (s, r), tensor, (send, recv) in zip(shapes, mine, theirs):
                    if name == "mpi4py":
                        comm.Alltoallv(send, recv)
                    else:  # the counts are known, as the MoE's one counts exchange makes them
                        ep.comm.exchange(tensor, s, grid.ep_set, r)
            samples.append(slowest((time.perf_counter() - start) / calls))
    comm.Free()
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"rows_per_rank_pair": rows, "bytes_per_call_mean": 4 * args.dim * sum(map(sum, rows)) / n,
            **{f"{k}_s_per_step": v for k, v in medians.items()},
            "psrt_over_mpi4py": medians["psrt"] / medians["mpi4py"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8, help="must divide by the world size")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25, help="for the dropped count only")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per window")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    n = hvd.size()
    if args.experts % n:
        parser.error(f"the world size {n} (= EP size) must divide --experts ({args.experts})")
    grid = ProcessGrid(dp=n, ep=n)
    x = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(1 + hvd.rank()))
    x.requires_grad_(True)
    models = {}
    for factor in (None, args.capacity_factor):
        torch.manual_seed(0)  # the same router and experts
        models[factor] = ep.MoE(args.dim, args.hidden, args.experts, top_k=args.top_k, capacity_factor=factor,
                                process_set=grid.ep_set)
    model = models[None]
    with torch.no_grad():
        models[args.capacity_factor](x)
    dropped = sum(hvd.allgather_object(models[args.capacity_factor].dropped, name="bench.moe.dropped"))
    for _ in range(args.warmup):
        step(model, x)
    windows = [window(args, model, x) for _ in range(args.repeats)]
    per_expert, rows = routing(args, model, x)
    baseline = alltoall_against_mpi4py(args, grid, rows) if n > 1 else None
    grid.free()
    if hvd.rank() != 0:
        return
    assignments = n * args.tokens * args.top_k
    step_s = statistics.median(w[0] for w in windows)
    a2a_per_rank = [statistics.median(w[1][r] for w in windows) for r in range(n)]
    a2a_s = statistics.fmean(a2a_per_rank)
    result = {"step_s": step_s, "a2a_s_per_step": a2a_s, "a2a_s_per_step_by_rank": a2a_per_rank,
              "a2a_share": statistics.median(w[2] for w in windows),
              "a2a_calls_per_step": statistics.median(w[3] for w in windows),
              "in_step_a2a_over_raw": a2a_s / baseline["mpi4py_s_per_step"] if baseline else None,
              "capacity_factor": args.capacity_factor, "dropped": dropped, "assignments": assignments}
    balance = max(per_expert) / statistics.fmean(per_expert)
    print(f"EP {n} (= world), {args.tokens} tokens/rank, dim {args.dim}, hidden {args.hidden}, {args.experts} "
          f"experts, top-{args.top_k}, dropless; median of {args.repeats} rounds, {args.steps}-step windows")
    print("| step ms | a2a ms/step (min-max over ranks) | a2a share | a2a calls/step | raw mpi4py ms/step "
          "(4 calls) | in step / raw | tokens/expert max/mean | dropped at capacity "
          f"{args.capacity_factor:g} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    raw = f"{baseline['mpi4py_s_per_step'] * 1e3:.2f}" if baseline else "-"
    ratio = f"{result['in_step_a2a_over_raw']:.2f}" if baseline else "-"
    print(f"| {step_s * 1e3:.1f} | {a2a_s * 1e3:.1f} ({min(a2a_per_rank) * 1e3:.1f}-{max(a2a_per_rank) * 1e3:.1f}) | "
          f"{result['a2a_share'] * 100:.1f}% | {result['a2a_calls_per_step']:g} | {raw} | {ratio} | {balance:.3f} | "
          f"{dropped} of {assignments} ({dropped / assignments * 100:.2f}%) |")
    print(f"tokens per expert (all ranks): {per_expert}")
    if baseline:
        print(f"4 data all-to-alls of a step alone (rows per rank pair {rows}, "
              f"{baseline['bytes_per_call_mean'] / 1e6:.2f} MB sent per rank per call on average): psrt exchange "
              f"{baseline['psrt_s_per_step'] * 1e3:.2f} ms, raw mpi4py Alltoallv "
              f"{baseline['mpi4py_s_per_step'] * 1e3:.2f} ms; psrt / mpi4py {baseline['psrt_over_mpi4py']:.2f} "
              f"({(baseline['psrt_s_per_step'] - baseline['mpi4py_s_per_step']) / 4 * 1e6:+.0f} us per call)")
    print(json.dumps({"benchmark": "moe", "ranks": n, "ep": n, "tokens": args.tokens, "dim": args.dim,
                      "hidden": args.hidden, "experts": args.experts, "top_k": args.top_k,
                      "tokens_per_expert": per_expert, "max_over_mean": balance, "result": result,
                      "alltoall_vs_mpi4py": baseline}))


if __name__ == "__main__":
    main()
