"""The machine probe behind ``psrt plan --measure``: a short psrun job that measures what the
cost model needs and writes a machine profile (:class:`psrt.plan.Machine`) as JSON.

    psrun -np 2 python -m psrt.plan.probe --out machine.json

Every rank measures at once, so each figure is what one rank gets while the others are busy
too (on a shared host, its share of the cores and of the memory bandwidth); the slowest
rank's time is taken (collectives after a barrier each, as the ranks of a step reach them
together).  Figures: float32 n × n matmul FLOP/s for a few n; causal fused attention's
FLOP/s for a few head dimensions; the fixed cost of a tiny transformer block's forward and
backward, and what it costs more split over every rank (TP, with and without sequence
parallelism); what a mid-sized block takes beyond all that, per byte of its activations; ``hvd.allreduce`` (the engine, as data
parallelism and ZeRO use it) and the direct path's all-reduce (as TP uses it) at a few sizes,
each fitted to a latency plus a bus bandwidth; a point-to-point message between ranks 0 and 1
(as pipelines send activations), fitted the same way; memcpy bandwidth; and the time of an
AdamW step per parameter.  ``--quick`` measures fewer sizes and repeats (for tests).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch

import psrt
import psrt.torch as hvd
from psrt import runtime, tp
from psrt.plan.cost import block_seconds
from psrt.plan.layout import Layout, precision
from psrt.plan.machine import Link, Machine
from psrt.plan.memory import layer_activations
from psrt.plan.model import Transformer
from psrt.topology import ProcessSet

MATMUL_SIZES = (64, 128, 256, 512, 1024)
HEAD_DIMS = (16, 64, 128)
MESSAGE_BYTES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
_TAG = 31


def _slowest(seconds: float) -> float:
    return float(hvd.allreduce(torch.tensor([seconds], dtype=torch.float64), op=hvd.Max, name="plan.probe.time"))


def _median_seconds(work: Callable[[], None], repeats: int, warmup: int = 2, together: bool = False) -> float:
    """Median seconds of ``work`` over ``repeats`` runs after ``warmup``, the slowest rank's.  All
    ranks start together; with ``together`` every run does (a barrier before each, as the ranks
    of a training step reach their collectives at about the same time)."""
    for _ in range(warmup):
        work()
    hvd.barrier()
    times = []
    for _ in range(repeats):
        if together:
            hvd.barrier()
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return _slowest(statistics.median(times))


def matmul_flops(sizes: tuple[int, ...], budget_s: float) -> list[tuple[int, float]]:
    points = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        calls = max(1, int(budget_s * 2e9 / (2 * n ** 3)))  # about budget_s at 2 GFLOP/s per call batch

        def work(a: torch.Tensor = a, b: torch.Tensor = b, calls: int = calls) -> None:
            for _ in range(calls):
                torch.mm(a, b)
        points.append((n, 2 * n ** 3 * calls / _median_seconds(work, 5)))
    return points


def attention_flops(head_dims: tuple[int, ...], repeats: int, sequence: int = 256) -> list[tuple[int, float]]:
    """Causal fused attention, forward and backward, over 2 × 8 heads of ``sequence`` tokens."""
    points = []
    for d in head_dims:
        q, k, v = (torch.randn(2, 8, sequence, d, requires_grad=True) for _ in range(3))
        grad = torch.randn(2, 8, sequence, d)

        def work(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, grad: torch.Tensor = grad) -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        flops = 3 * 2 * 8 * 2 * sequence * sequence * d  # fwd + bwd; causal: half of the 4·s²·d
        points.append((d, flops / _median_seconds(work, repeats)))
    return points


def _block_seconds(dim: int, heads: int, rows: int, sequence: int, repeats: int,
                   process_set: ProcessSet | None = None, sequence_parallel: bool = False) -> float:
    """Forward and backward of one of psrt's transformer blocks, local or split over ``process_set``."""
    tp.manual_seed(0, process_set)
    block = tp.ParallelTransformerBlock(dim, heads, process_set=process_set, sequence_parallel=sequence_parallel)
    parts = process_set.size() if sequence_parallel else 1
    x = torch.randn(rows, sequence // parts, dim, requires_grad=True)
    return _median_seconds(lambda: block(x).sum().backward(), repeats)


def tp_overheads(local: float, repeats: int) -> tuple[float, float]:
    """What a tiny block split over every rank costs beyond the ``local`` one: without and with
    sequence parallelism."""
    ranks = hvd.size()
    if ranks == 1:
        return 0.0, 0.0
    world = psrt.global_process_set
    split = _block_seconds(8 * ranks, ranks, 1, 4 * ranks, repeats, world)
    sequence_parallel = _block_seconds(8 * ranks, ranks, 1, 4 * ranks, repeats, world, sequence_parallel=True)
    return max(0.0, split - local), max(0.0, sequence_parallel - local)


def elementwise_seconds_per_byte(machine: Machine, repeats: int) -> float:
    """What a mid-sized block's forward and backward take beyond its products, its attention and
    its fixed cost, per byte of the activations it keeps (fp32): GELU, LayerNorm, additions,
    copies.  ``machine`` holds the other figures, already measured."""
    dim, heads, rows, sequence = 128, 8, 4, 128
    model = Transformer(layers=1, hidden=dim, heads=heads, vocab=2, sequence_length=sequence)
    layout = Layout(dp=1, tp=1, pp=1, cp=1, zero=0, micro_batch=rows, micro_batches=1)
    fp32 = precision("fp32")
    modelled = block_seconds(model, "layer", model.layer_params(), layout, fp32, machine)
    measured = _block_seconds(dim, heads, rows, sequence, 3 * repeats)
    return max(0.0, measured - modelled) / layer_activations(model, layout, fp32.activation, "none")


def _collective_link(run: Callable[[torch.Tensor], None], sizes: tuple[int, ...], repeats: int,
                     ranks: int) -> tuple[Link, list]:
    points = []
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)
        seconds = _median_seconds(lambda tensor=tensor: run(tensor), repeats, together=True)
        points.append((2 * (ranks - 1) / ranks * nbytes, seconds))
    return Link.fit(points), [{"bytes": n, "seconds": s} for n, (_, s) in zip(sizes, points)]


def engine_allreduce(sizes: tuple[int, ...], repeats: int) -> tuple[Link, list]:
    return _collective_link(lambda t: hvd.allreduce_(t, name=f"plan.probe.allreduce.{t.numel()}"), sizes, repeats,
                            hvd.size())


def direct_allreduce(sizes: tuple[int, ...], repeats: int) -> tuple[Link, list]:
    return _collective_link(lambda t: tp.comm.all_reduce_(t, psrt.global_process_set), sizes, repeats, hvd.size())


def point_to_point(sizes: tuple[int, ...], repeats: int) -> tuple[Link, list]:
    """Ping-pong between ranks 0 and 1 over the world's direct group (as pipeline stages send);
    one message is half a round trip."""
    group = runtime.current().topology.direct(psrt.global_process_set)
    rank, points = hvd.rank(), []
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4)

        def work(tensor: torch.Tensor = tensor) -> None:
            if rank == 0:
                group.wait(group.send(tensor, 1, _TAG), "a probe message", "the probe's message to rank 1", (1,))
                group.recv(1, _TAG, kind="a probe message", what="the probe's reply from rank 1")
            elif rank == 1:
                group.recv(0, _TAG, kind="a probe message", what="the probe's message from rank 0")
                group.wait(group.send(tensor, 0, _TAG), "a probe message", "the probe's reply to rank 0", (0,))
        points.append((nbytes, _median_seconds(work, repeats, together=True) / 2))
    return Link.fit(points), [{"bytes": n, "seconds": s} for n, s in points]


def memcpy_bandwidth(nbytes: int, repeats: int) -> float:
    source, target = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return nbytes / _median_seconds(lambda: target.copy_(source), repeats)


def optimizer_seconds_per_param(numel: int, repeats: int) -> float:
    """An AdamW step over ``numel`` parameters held in 1M-element tensors (ZeRO's bucket size)."""
    params = [torch.zeros(min(1_000_000, numel - start), requires_grad=True) for start in range(0, numel, 1_000_000)]
    for param in params:
        param.grad = torch.randn(param.numel())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    return _median_seconds(optimizer.step, repeats) / numel


def measure(quick: bool = False) -> Machine:
    """Run every measurement (collective: every rank of the job must call it) and return the profile."""
    repeats = 5 if quick else 15
    sizes = MESSAGE_BYTES[:2] + MESSAGE_BYTES[-1:] if quick else MESSAGE_BYTES
    matmul = matmul_flops(MATMUL_SIZES[::2] if quick else MATMUL_SIZES, 0.02 if quick else 0.1)
    attention = attention_flops(HEAD_DIMS[::2] if quick else HEAD_DIMS, repeats)
    # a tiny block: its FLOPs cost nothing, what it takes is the fixed cost of any block
    overhead = _block_seconds(8, 1, 1, 4, 3 * repeats)
    tp_overhead, sp_overhead = tp_overheads(overhead, 3 * repeats)
    engine, engine_points = engine_allreduce(sizes, repeats)
    direct, direct_points = direct_allreduce(sizes, repeats)
    p2p, p2p_points = point_to_point(sizes, repeats) if hvd.size() > 1 else (Link(0.0, 1e12), [])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = Machine(
        name=f"measured on {platform.node()} by {hvd.size()} ranks, {torch.get_num_threads()} torch threads each, {when}",
        measured=True, matmul=tuple(matmul), attention=tuple(attention), layer_overhead_s=overhead,
        tp_layer_overhead_s=tp_overhead, sp_layer_overhead_s=sp_overhead, elementwise_s_per_byte=0.0, engine_allreduce=engine, direct_allreduce=direct, p2p=p2p,
        optimizer_s_per_param=optimizer_seconds_per_param(1_000_000 if quick else 4_000_000, repeats),
        memcpy_bandwidth=memcpy_bandwidth(16 << 20 if quick else 64 << 20, repeats),
        details={"ranks": hvd.size(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                 "engine_allreduce": engine_points, "direct_allreduce": direct_points, "p2p": p2p_points})
    return dataclasses.replace(machine, elementwise_s_per_byte=elementwise_seconds_per_byte(machine, repeats))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m psrt.plan.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where rank 0 writes the JSON profile")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    hvd.init()
    machine = measure(args.quick)
    if hvd.rank() == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(machine.to_json() + "\n")
        print(json.dumps({"machine_profile": args.out}))
    hvd.shutdown()


if __name__ == "__main__":
    main()
