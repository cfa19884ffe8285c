"""ZeRO benchmark: per-rank bytes of parameters, gradients and optimizer state, and step time,
for plain data parallelism and ZeRO stages 0-3, against ZeRO's formulas, in one job.

Run under a launcher (``make bench-zero`` runs 2 and 4 ranks)::

    psrun -np 2 python benchmarks/zero.py
    psrun -np 4 python benchmarks/zero.py --compute-dtype bfloat16

Model: an MLP of ``--layers`` square ``--width`` linear layers (default 6 x 1024: 6.3 M
parameters, 6 units for stage 3), Adam, batch 32 rows per rank, one torch thread per rank.
Modes:

  dp      ``hvd.DistributedOptimizer`` (allreduce buckets, the baseline);
  stage0  ``ZeroOptimizer(stage=0)``: the same data parallelism through ZeRO's code;
  stage1  optimizer state sharded; gradients reduce-scattered and parameters all-gathered
          around the step;
  stage2  gradients sharded too, reduce-scattered during backward;
  stage3  parameters sharded too, gathered per layer around its forward and backward.

Bytes are read from the tensors each mode holds after a backward (so gradients exist) in
the second step (so optimizer state exists), every storage counted once; ``formula`` is
ZeRO's (parameters P, gradients G, optimizer K bytes per element: 4/4/8 for fp32 Adam,
2/2/12 for bf16 compute with fp32 masters; dp in bf16 is pure bf16, 2/2/4).  ``peak gathered`` is stage 3's largest
amount of gathered parameters at any time.

Step time: the modes take turns; each round gives every mode 2 untimed steps and then a
window of ``--steps`` steps timed after a barrier, taking the slowest rank.  The figure is
the median over ``--rounds`` rounds, and ``vs dp`` divides it by dp's.  Rank 0 prints a
table and one JSON line.  Nothing is asserted.  It also draws benchmarks/plots/zero_memory.png,
one panel per rank count run so far (kept in benchmarks/plots/zero_memory.json).

``--adam-sizes`` instead times torch's Adam step (one thread, rank 0 alone) on the same
6.3 M elements cut into tensors of different sizes, which is what sets ZeRO's default
bucket size on CPU: every bucket is one tensor for the optimizer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import psrt.torch as hvd
from psrt.zero import ZeroOptimizer, expected_bytes
from psrt.zero.memory import storage_bytes

import _plots

MODES = ("dp", "stage0", "stage1", "stage2", "stage3")
ROWS = 32


def build(mode: str, args, dtype: torch.dtype | None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    if mode == "dp":
        if dtype is not None:
            model.to(dtype)
        optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-4),
                                             model.named_parameters())
    else:
        optimizer = ZeroOptimizer(model, torch.optim.Adam, stage=int(mode[-1]), compute_dtype=dtype, lr=1e-4)
    return model, optimizer


def dp_bytes(model, optimizer) -> dict[str, int]:
    seen: set[int] = set()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": storage_bytes(model.parameters(), seen),
            "grads": storage_bytes((p.grad for p in model.parameters()), seen),
            "optimizer": storage_bytes(state, seen)}


def step(model, optimizer, x, measure: bool = False) -> dict | None:
    model(x).float().pow(2).mean().backward()
    held = None
    if measure:
        held = optimizer.memory_report() if isinstance(optimizer, ZeroOptimizer) else dp_bytes(model, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return held


def slowest(seconds: float) -> float:
    return float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name="bench.zero.time"))


def adam_step_by_tensor_size(numel: int = 6_300_000, rounds: int = 15) -> dict[str, float]:
    """Median seconds of one Adam step over ``numel`` elements held in tensors of each size."""
    optimizers = {}
    for size in (numel, 5_000_000, 1_000_000, 250_000):
        sizes = [size] * (numel // size) + ([numel % size] if numel % size else [])
        tensors = [torch.zeros(n, requires_grad=True) for n in sizes]
        for tensor in tensors:
            tensor.grad = torch.randn(tensor.numel())
        optimizers[f"{size / 1e6:g}M"] = torch.optim.Adam(tensors, lr=1e-3)
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(rounds):  # the sizes take turns
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values[3:]) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="dp is always included")
    parser.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--adam-sizes", action="store_true", help="only time Adam by tensor size (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    if args.adam_sizes:
        if hvd.rank() == 0:
            medians = adam_step_by_tensor_size()
            print("| tensor size | Adam step ms (6.3 M elements) |\n| --- | --- |")
            for name, seconds in medians.items():
                print(f"| {name} | {seconds * 1e3:.1f} |")
            print(json.dumps({"benchmark": "zero.adam_sizes", "seconds": medians}))
        return
    dtype = None if args.compute_dtype == "float32" else torch.bfloat16
    modes = ["dp"] + [mode for mode in args.modes if mode != "dp"]
    setups = {mode: build(mode, args, dtype) for mode in modes}
    x = torch.randn(ROWS, args.width, generator=torch.Generator().manual_seed(hvd.rank()))
    x = x.to(dtype) if dtype is not None else x
    held = {}
    for mode, (model, optimizer) in setups.items():
        step(model, optimizer, x)
        held[mode] = step(model, optimizer, x, measure=True)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, (model, optimizer) in setups.items():
            for _ in range(2):
                step(model, optimizer, x)
            hvd.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, optimizer, x)
            times[mode].append(slowest((time.perf_counter() - start) / args.steps))
    if hvd.rank() != 0:
        return
    numel = sum(p.numel() for p in setups["dp"][0].parameters())
    per_element = (4, 4, 8) if dtype is None else (2, 2, 12)
    element = 4 if dtype is None else 2
    median = {mode: statistics.median(times[mode]) for mode in modes}
    peak = setups["stage3"][1].gatherer.peak_gathered_bytes if "stage3" in setups else 0
    print(f"{hvd.size()} ranks, {numel / 1e6:.2f} M parameters, Adam, {args.compute_dtype} compute; "
          f"MB per rank measured (formula); step time median of {args.rounds} rounds")
    print("| mode | params | grads | optimizer | total | step ms | vs dp |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = {}
    for mode in modes:
        stage = 0 if mode == "dp" else int(mode[-1])
        # dp keeps Adam's two moments in the model's dtype and has no master copy.
        p, g, k = (element, element, 2 * element) if mode == "dp" else per_element
        want = expected_bytes(stage, numel, hvd.size(), param_bytes=p, grad_bytes=g, optimizer_bytes=k)
        got = held[mode]
        cells = [f"{got[k] / 1e6:.1f} ({want[k] / 1e6:.1f})" for k in ("params", "grads", "optimizer")]
        total = sum(got.values())
        print(f"| {mode} | {' | '.join(cells)} | {total / 1e6:.1f} ({sum(want.values()) / 1e6:.1f}) | "
              f"{median[mode] * 1e3:.1f} | {median[mode] / median['dp']:.2f} |")
        rows[mode] = {"bytes": got, "formula": want, "step_s": median[mode], "vs_dp": median[mode] / median["dp"]}
    print(f"stage 3 peak gathered parameters: {peak / 1e6:.1f} MB (largest layer "
          f"{(args.width * args.width + args.width) * per_element[0] / 1e6:.1f} MB)")
    print(json.dumps({"benchmark": "zero", "ranks": hvd.size(), "params": numel, "compute": args.compute_dtype,
                      "modes": rows, "stage3_peak_gathered_bytes": peak}))
    runs = _plots.remember("zero_memory", f"{hvd.size()} ranks, {args.compute_dtype}", {
        "ranks": hvd.size(), "params": numel, "compute": args.compute_dtype,
        "modes": {mode: {"bytes": row["bytes"], "formula": row["formula"]} for mode, row in rows.items()}})
    print("# plot:", _plots.zero_memory(runs))


if __name__ == "__main__":
    main()
