"""ZeRO-3's host work per step against torch FSDP2's, in one process on the CPU: Python
function calls per training step and the step's wall time, for plain torch, FSDP2 and psrt's
ZeRO-3 on the same GPT, in the same run.

One rank, so no byte crosses a wire and the compute is the same for all three: what differs is
the Python each framework runs around it (hooks, gathers and frees of parameters, gradient
reductions, bookkeeping).  Run from the repository root::

    python benchmarks/zero3_host.py                    # about 1 min on a 2-core VM
    psrun -np 1 python benchmarks/zero3_host.py        # the same, under the launcher

Model: benchmarks/_peers_gpt.py's plain-torch GPT, 12 layers, 64 wide, 4 heads, vocabulary
128, 32 positions (``nn.Sequential(embedding, block x 12, head)``, 0.62 M parameters), AdamW
(lr 1e-3), 4 random sequences per step, fp32, one torch thread.  Implementations:

  torch   the model and ``torch.optim.AdamW``, no process group;
  fsdp2   ``fully_shard`` on every entry of the Sequential (embedding, each block, head) and on
          the root, over a one-rank gloo group (``init_process_group("gloo", rank=0,
          world_size=1, store=HashStore())``), as benchmarks/gpu.py applies it;
  zero3   ``psrt.zero.ZeroOptimizer(model, torch.optim.AdamW, stage=3)``, its default units.

Calls: Python function calls per step, counted as ``sys.setprofile``'s ``"call"`` events (C
functions are not counted) over ``--count-steps`` steps after ``--warmup`` untimed ones, on
every Python thread: the count runs in a child process of this script that installs the
hook with ``threading.setprofile`` too before psrt or torch start a thread (the engine's).
Host time: each implementation's step in the parent, no hook installed, taking turns in
``--rounds`` rounds of ``--steps`` steps; the figure is the median step.  Each
implementation trains its own copy from the same seed on the same batch, so their losses
agree (printed).  Prints a table and one JSON line; nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peers_gpt import GPTConfig, build_blocks, loss_fn, synthetic_batch  # noqa: E402

CONFIG = GPTConfig(vocab_size=128, sequence_length=32, dim=64, heads=4, layers=12)
IMPLS = ("torch", "fsdp2", "zero3")
LR = 1e-3

Step = Callable[[], float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--count-steps", type=int, default=3, help="steps whose calls are counted (default 3)")
    parser.add_argument("--units", default=None, help="ZeroOptimizer's units= (default: not passed, its default)")
    parser.add_argument("--count-only", action="store_true", help=argparse.SUPPRESS)  # the child's part
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.rows, args.steps, args.rounds, args.count_steps) < 1 or args.warmup < 0:
        parser.error("--rows, --steps, --rounds and --count-steps must be at least 1, --warmup at least 0")
    return args


def init_runtimes() -> None:
    """psrt in one process (no launcher needed) and a one-rank gloo group for FSDP2."""
    import torch.distributed as dist
    import psrt.torch as hvd
    hvd.init()
    if hvd.size() != 1:
        raise SystemExit(f"benchmarks/zero3_host.py runs on one rank, not {hvd.size()}: psrun -np 1")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())


def build(impl: str, x: torch.Tensor, y: torch.Tensor, units: str | None) -> Step:
    """``impl``'s training step (returning the loss) on its own copy of the model."""
    model = nn.Sequential(*build_blocks(CONFIG))
    if impl == "zero3":
        from psrt.zero import ZeroOptimizer
        optimizer = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=LR,
                                  **({} if units is None else {"units": units}))
    elif impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (1,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> float:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return step


class CallCounter:
    """Counts ``"call"`` events on every thread while ``counting`` is set."""

    def __init__(self) -> None:
        self.calls, self.counting = 0, False

    def __call__(self, frame, event, arg) -> None:
        if event == "call" and self.counting:
            self.calls += 1

    def install(self) -> None:
        threading.setprofile(self)  # threads started from now on (psrt's engine thread)
        sys.setprofile(self)


def count_calls(args: argparse.Namespace) -> dict[str, float]:
    """The child's part: Python calls per step of each implementation."""
    counter = CallCounter()
    counter.install()
    torch.set_num_threads(1)
    init_runtimes()
    x, y = synthetic_batch(CONFIG, args.rows, seed=1)
    calls = {}
    for impl in IMPLS:
        step = build(impl, x, y, args.units)
        for _ in range(args.warmup):
            step()
        counter.calls, counter.counting = 0, True
        for _ in range(args.count_steps):
            step()
        counter.counting = False
        calls[impl] = counter.calls / args.count_steps
    sys.setprofile(None)
    return calls


def time_steps(args: argparse.Namespace) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds of every timed step and the losses, per implementation, taking turns."""
    torch.set_num_threads(1)
    init_runtimes()
    x, y = synthetic_batch(CONFIG, args.rows, seed=1)
    steps = {impl: build(impl, x, y, args.units) for impl in IMPLS}
    losses: dict[str, list[float]] = {impl: [step()] for impl, step in steps.items()}
    for step in steps.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {impl: [] for impl in steps}
    order = list(steps)
    for index in range(args.rounds):
        shift = index % len(order)
        for impl in order[shift:] + order[:shift]:
            for _ in range(args.steps):
                start = time.perf_counter()
                loss = steps[impl]()
                times[impl].append(time.perf_counter() - start)
            losses[impl].append(loss)
    return times, losses


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.count_only:
        print(json.dumps(count_calls(args)), flush=True)
        return {}
    child = [sys.executable, __file__, "--count-only", "--rows", str(args.rows), "--warmup", str(args.warmup),
             "--count-steps", str(args.count_steps)] + ([] if args.units is None else ["--units", args.units])
    done = subprocess.run(child, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the counting child failed:\n{done.stderr[-3000:]}")
    calls = json.loads(done.stdout.strip().splitlines()[-1])
    times, losses = time_steps(args)
    median_ms = {impl: statistics.median(values) * 1e3 for impl, values in times.items()}
    record = {
        "benchmark": "zero3_host", "device": "cpu", "units": args.units or "default",
        "model": {"layers": CONFIG.layers, "dim": CONFIG.dim, "heads": CONFIG.heads, "vocab": CONFIG.vocab_size,
                  "sequence": CONFIG.sequence_length, "rows": args.rows},
        "calls_per_step": {impl: round(value) for impl, value in calls.items()},
        "median_step_ms": {impl: round(value, 3) for impl, value in median_ms.items()},
        "steps_timed": args.steps * args.rounds,
        "loss_first_last": {impl: [round(values[0], 6), round(values[-1], 6)] for impl, values in losses.items()},
        "ratios": {"zero3/fsdp2 calls": round(calls["zero3"] / calls["fsdp2"], 3),
                   "zero3/fsdp2 time": round(median_ms["zero3"] / median_ms["fsdp2"], 3),
                   "zero3/torch time": round(median_ms["zero3"] / median_ms["torch"], 3)},
    }
    print(f"\nGPT {CONFIG.layers}x{CONFIG.dim}, AdamW, {args.rows}x{CONFIG.sequence_length} tokens a step, one "
          f"process on the CPU; calls over {args.count_steps} steps, time median of {record['steps_timed']} steps")
    print(f"{'implementation':<16}{'calls/step':>12}{'/ fsdp2':>9}{'step ms':>10}{'/ fsdp2':>9}{'last loss':>12}")
    for impl in IMPLS:
        print(f"{impl:<16}{calls[impl]:>12.0f}{calls[impl] / calls['fsdp2']:>9.2f}{median_ms[impl]:>10.2f}"
              f"{median_ms[impl] / median_ms['fsdp2']:>9.2f}{losses[impl][-1]:>12.5f}")
    print(json.dumps(record), flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
