"""The planner's step times against published training throughput on H100 nodes, in one process.

    python benchmarks/plan_published.py            # table, then one JSON line
    make bench-plan-published

Each case is a published run: its model, GPU count, batch and layout, and the throughput its
authors report.  The planner (``psrt.plan.layouts`` on the shipped ``h100`` profile, bf16)
costs that layout, with the choices the publication fixes pinned and the rest (micro-batch,
recomputation) searched, in the publication's GPU memory; its step time gives tokens/s/GPU
and, with the publication's own FLOP count per token, MFU over 989 TFLOP/s.  Reported:
predicted, published and their ratio (above 1: the planner is optimistic), and the same
ratio with products and attention at the datasheet's peak ("at peak": what the profile's
fractions of peak do).  Nothing is tuned to these numbers: the fractions were measured on an
H100 beforehand (see psrt/plan/profiles/h100.json).

Sources:

* torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (commit 9dec370, 2024-12): Llama 3.1
  8B, FSDP on 8 H100 (Grand Teton: H100 96GB HBM2e at 2.4 TB/s, 500 W), local batch 2,
  sequence 8192 (train_configs/llama3_8b.toml), selective activation checkpointing (op
  policy: keeps every other matmul's output), bf16, no torch.compile, no Float8: 5,762
  tokens/s/GPU; "33% to 39% MFU" (without and with torch.compile).  MFU by
  torchtitan's count: 6 × non-embedding parameters + 12 · layers · heads · head dim · sequence
  FLOPs per token, over 989 TFLOP/s.
* Megatron-LM README, "Performance Benchmarking" (images/model_table.png, Megatron-Core
  r0.8.0): GPT models with vocabulary 131,072 and sequence 4,096 on H100, weak scaling with
  data parallelism 48; per model its heads, hidden size, layers, TP, PP, GPUs, global batch
  and MFU (41-48 %).  Megatron's FLOP count per token: 6 × the layers' and the output
  projection's matrices + 12 · layers · hidden · sequence (attention non-causal), as in its
  ``num_floating_point_operations``.  Megatron overlaps DP and TP communication and uses
  the distributed optimizer (ZeRO-1), sequence parallelism and, from PP 2, interleaved
  schedules (psrt costs 1F1B).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from psrt import plan

PEAK = 989e12


@dataclass(frozen=True)
class Case:
    """A published run and the layout choices it fixes."""

    name: str
    model: plan.Transformer
    gpus: int
    global_batch: int
    pins: dict
    memory: str  # per GPU, of the publication's GPUs
    published_tps: float  # tokens/s/GPU
    published_mfu: float
    source: str


def megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
             mfu: float) -> Case:
    model = plan.Transformer(layers=layers, hidden=hidden, heads=heads, vocab=131072, sequence_length=4096)
    pins = {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "zero": 1}
    tps = mfu * PEAK / flops_per_token(model)
    return Case(f"Megatron GPT {size}", model, gpus, batch, pins, "80GB", tps, mfu, "Megatron-LM README, model table")


def flops_per_token(model: plan.Transformer) -> float:
    """Model FLOPs per token as torchtitan and Megatron count them (no recomputation, attention
    not halved for causality): 6 per parameter of every matrix but the embedding, and 12 · L · h · s."""
    h = model.hidden
    qkv = h + 2 * h // model.heads * (model.kv_heads or model.heads)
    matrices = model.layers * (qkv * h + h * h + model.mlp_matrices * model.ffn_hidden * h)
    return 6 * (matrices + model.vocab * h) + 12 * model.layers * h * model.sequence_length


LLAMA_8B = plan.Transformer(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, vocab=128256,
                            sequence_length=8192)
CASES = [
    Case("torchtitan Llama 3.1 8B, FSDP", LLAMA_8B, 8, 16,
         {"dp": 8, "tp": 1, "pp": 1, "zero": 3, "recompute": "selective"}, "96GB",
         5762, 5762 * flops_per_token(LLAMA_8B) / PEAK, "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, table 1"),
    megatron("1.7B", 16, 2048, 24, 1, 1, 48, 192, 0.41),
    megatron("7.1B", 32, 4096, 30, 2, 1, 96, 192, 0.47),
    megatron("16B", 48, 6144, 32, 4, 1, 192, 192, 0.49),
    megatron("32B", 56, 7168, 48, 8, 1, 384, 192, 0.46),
    megatron("70B", 64, 8192, 84, 8, 2, 768, 384, 0.42),
    megatron("119B", 80, 10240, 92, 8, 4, 1536, 768, 0.43),
]


def at_peak(machine: plan.Machine) -> plan.Machine:
    """The profile with products and attention at the datasheet's peak: what the measured
    fractions of peak change."""
    return replace(machine, name=f"{machine.name.split()[0]} at peak FLOP/s", matmul=((1, PEAK),),
                   attention=((1, PEAK),))


def predict(case: Case, machine: plan.Machine) -> dict:
    best = plan.layouts(case.model, global_batch=case.global_batch, ranks=case.gpus, machine=machine,
                        memory_per_rank=case.memory, precision="bf16", **case.pins)[0]
    peak = plan.evaluate(case.model, best.layout, global_batch=case.global_batch, machine=at_peak(machine),
                         precision=plan.precision("bf16"))
    tokens = case.global_batch * case.model.sequence_length / case.gpus
    tps, time = tokens / best.time.total, best.time
    return {"case": case.name, "layout": best.layout.name, "step_s": time.total, "predicted_tps": tps,
            "published_tps": case.published_tps, "predicted_mfu": tps * flops_per_token(case.model) / PEAK,
            "published_mfu": case.published_mfu, "ratio": tps / case.published_tps,
            "ratio_at_peak": tokens / peak.time.total / case.published_tps,
            "communication_share": time.communication / time.total, "bubble_share": time.bubble / time.total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default="h100", help="shipped profile or profile file (default h100)")
    args = parser.parse_args()
    machine = plan.gpus.resolve(args.machine)
    rows = [predict(case, machine) for case in CASES]
    print(f"machine: {machine.name}")
    print(f"{'case':30} {'layout costed':38} {'step':>8} {'tok/s/GPU':>10} {'published':>10} {'MFU':>6} "
          f"{'pub.':>6} {'pred/pub':>8} {'at peak':>8} {'comm':>5} {'bubble':>6}")
    for r in rows:
        print(f"{r['case']:30} {r['layout']:38} {r['step_s']:7.3f}s {r['predicted_tps']:10,.0f} "
              f"{r['published_tps']:10,.0f} {r['predicted_mfu']:6.1%} {r['published_mfu']:6.1%} {r['ratio']:8.2f} "
              f"{r['ratio_at_peak']:8.2f} {r['communication_share']:5.0%} {r['bubble_share']:6.0%}")
    print(json.dumps({"benchmark": "plan_published", "machine": machine.name.split()[0], "rows": rows}))


if __name__ == "__main__":
    main()
