"""psrt's own overhead on one GPU: the step time of a GPT-2-small-sized model under
``hvd.DistributedOptimizer`` and under ZeRO-3, against plain torch (AdamW, no process group)
and against torch FSDP2 (``fully_shard`` on a one-rank NCCL group), in the same run.

One rank, so nothing crosses a wire: what psrt adds is its engine (negotiation, fusion, a
one-rank NCCL allreduce) and, for ZeRO-3, its units' gathers and frees (copies on the GPU
over one rank, no collective); the ratios psrt/plain and psrt-ZeRO-3/FSDP2 are the figures.  Run from the repository root::

    psrun -np 1 python3 benchmarks/gpu.py                      # GPT-2 small, about 1 min on an H100
    python benchmarks/gpu.py --device cpu --tiny --steps 3     # the script itself, on a CPU

Model: benchmarks/_peers_gpt.py's plain-torch GPT at GPT-2 small's shape (12 layers, 768
wide, 12 heads, vocabulary 50257, 1024 positions; the head is not tied to the embedding,
so 163 M parameters rather than 124 M), AdamW (lr 1e-4), ``--rows`` random sequences per
step, bf16 autocast on the GPU.  Each implementation trains its own copy from the same seed
on the same batch; they take turns in ``--rounds`` rounds of ``--steps`` timed steps (after
``--warmup`` untimed ones), each step between two ``torch.cuda.synchronize()``.  The figure
is the median step.  Prints a table and one JSON line; ``--json-out`` writes the JSON too.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psrt.torch as hvd  # noqa: E402
from _peers_gpt import GPTConfig, build_blocks, loss_fn, synthetic_batch  # noqa: E402
from psrt.zero import ZeroOptimizer  # noqa: E402

GPT2_SMALL = GPTConfig(vocab_size=50257, sequence_length=1024, dim=768, heads=12, layers=12)
TINY = GPTConfig(vocab_size=128, sequence_length=32, dim=64, heads=4, layers=2)
IMPLS = ("torch", "hvd", "zero3", "fsdp2")
LR = 1e-4

Step = Callable[[], float]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (to check the script)")
    parser.add_argument("--rows", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--sequence", type=int, default=None, help="tokens per sequence (default the model's)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round (default 5)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    if min(args.rows, args.warmup + 1, args.steps, args.rounds) < 1:
        parser.error("--rows, --steps and --rounds must be at least 1, --warmup at least 0")
    return args


def init_torch_group(backend: str) -> None:
    """A one-rank torch.distributed group for FSDP2, on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def build(impl: str, config: GPTConfig, device: torch.device, x: torch.Tensor, y: torch.Tensor) -> tuple[Step, int]:
    """``impl``'s training step (returning the loss) on its own copy of the model, and the
    model's number of parameters."""
    model = nn.Sequential(*build_blocks(config)).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    if impl == "hvd":
        optimizer = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR),
                                             named_parameters=model.named_parameters())
    elif impl == "zero3":
        optimizer = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=LR)
    elif impl == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh(device.type, (1,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" \
        else contextlib.nullcontext

    def step() -> float:
        with autocast():
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return step, parameters


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(steps: dict[str, Step], device: torch.device, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of every timed step, per implementation, the implementations taking turns."""
    times: dict[str, list[float]] = {impl: [] for impl in steps}
    order = list(steps)
    for index in range(args.rounds):
        shift = index % len(order)
        for impl in order[shift:] + order[:shift]:
            for _ in range(args.warmup if index == 0 else 1):
                steps[impl]()
            for _ in range(args.steps):
                synchronize(device)
                start = time.perf_counter()
                steps[impl]()
                synchronize(device)
                times[impl].append(time.perf_counter() - start)
    return times


def summarize(times: dict[str, list[float]], first_losses: dict[str, float], errors: dict[str, str],
              config: GPTConfig, parameters: int, device: torch.device, args: argparse.Namespace) -> dict:
    """The JSON record: medians, the ratios that matter, and what ran."""
    median = {impl: statistics.median(samples) for impl, samples in times.items()}

    def ratio(a: str, b: str) -> float | None:
        return round(median[a] / median[b], 3) if a in median and b in median else None

    return {
        "benchmark": "gpu", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": {"layers": config.layers, "dim": config.dim, "heads": config.heads, "vocab": config.vocab_size,
                  "sequence": args.sequence or config.sequence_length, "parameters": parameters},
        "rows": args.rows, "steps": args.steps * args.rounds, "warmup": args.warmup,
        "median_step_s": {impl: round(value, 5) for impl, value in median.items()},
        "first_loss": first_losses, "errors": errors,
        "ratios": {"hvd/torch": ratio("hvd", "torch"), "zero3/torch": ratio("zero3", "torch"),
                   "zero3/fsdp2": ratio("zero3", "fsdp2"), "fsdp2/torch": ratio("fsdp2", "torch")},
    }


def print_table(record: dict) -> None:
    print(f"\n{record['device']}: GPT {record['model']['layers']}x{record['model']['dim']}, "
          f"{record['model']['parameters'] / 1e6:.1f} M parameters, {record['rows']} x "
          f"{record['model']['sequence']} tokens a step, median of {record['steps']} steps")
    print(f"{'implementation':<16}{'step (ms)':>12}{'/ torch':>10}")
    base = record["median_step_s"].get("torch")
    for impl, seconds in record["median_step_s"].items():
        print(f"{impl:<16}{seconds * 1e3:>12.2f}{(seconds / base if base else float('nan')):>10.3f}")
    for impl, error in record["errors"].items():
        print(f"{impl:<16}failed: {error}")
    print("ratios: " + ", ".join(f"{k} {v}" for k, v in record["ratios"].items() if v is not None))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False); "
                         "use --device cpu --tiny to check the script on a CPU")
    hvd.init()
    if hvd.size() != 1:
        raise SystemExit(f"benchmarks/gpu.py runs on one rank, not {hvd.size()}: psrun -np 1")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = TINY if args.tiny else GPT2_SMALL
    if args.sequence:
        config = GPTConfig(**{**config.__dict__, "sequence_length": args.sequence})
    x, y = (t.to(device) for t in synthetic_batch(config, args.rows, seed=1))
    init_torch_group("nccl" if device.type == "cuda" else "gloo")
    steps, first_losses, errors, parameters = {}, {}, {}, 0
    for impl in IMPLS:
        try:
            steps[impl], parameters = build(impl, config, device, x, y)
            first_losses[impl] = round(steps[impl](), 4)  # the same seed and batch: the same loss
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            steps.pop(impl, None)
            errors[impl] = f"{type(exc).__name__}: {exc}"[:300]
    record = summarize(measure(steps, device, args), first_losses, errors, config, parameters, device, args)
    print_table(record)
    print(json.dumps(record), flush=True)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(record, indent=1) + "\n")
    dist.destroy_process_group()
    hvd.shutdown()
    return record


if __name__ == "__main__":
    main()
