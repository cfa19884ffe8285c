"""The planner's bytes per rank against what psrt measures, on 2 ranks.

* ZeRO: the ZeRO benchmark's model (benchmarks/zero.py: 6 square Linear layers of 1024,
  Adam), wrapped at stages 0-3 in fp32 (and, narrowed to 256, with bf16 compute: 2 + 2 + 12
  bytes per parameter); ``memory_report()`` after the second step's backward (gradients and
  optimizer state both exist) against the planner's parameters, gradients and optimizer
  state for ``from_module(model)``.
* The probe behind ``psrt plan --measure``, in its quick form: a complete, positive profile
  that survives its JSON round trip.
* The tiny GPT on dp2, tp2 (with and without sequence parallelism), pp2 (1F1B) and with
  recomputation and dropout: one step, then the pipeline's measured peak activation bytes
  (``Pipeline.profile.peak_activation_bytes``) and the stage's parameter bytes against the
  planner's for this rank's stage.  A stage after the first holds the input gradient it
  sends back until the message is delivered, which may happen before its peak or not; the
  planner counts it, and a measurement without it is compared with the prediction less it.

Each check passes when every figure is within 10 % of the prediction.  Every rank prints
its figures as JSON lines ({"figure": ...}) for the record.
"""
from __future__ import annotations

import json
import os
import sys

import torch

import _harness
import psrt.torch as hvd
from psrt import plan
from psrt.grid import ProcessGrid
from psrt.plan import probe
from psrt.zero import ZeroOptimizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
from tiny_gpt import GPTConfig, batch, build_trainer, corpus, train_step  # noqa: E402

TOLERANCE = 0.10
DATA, ALPHABET = corpus()
GPT_BATCH = 8


def _close(what: str, measured: float, predicted: float) -> None:
    print(json.dumps({"figure": what, "rank": hvd.rank(), "measured": measured, "predicted": predicted}), flush=True)
    assert abs(measured - predicted) <= TOLERANCE * max(predicted, 1), \
        f"{what}: measured {measured} bytes, predicted {predicted} ({measured / max(predicted, 1):.3f} x)"


def check_zero(name: str, stage: int, dtype: torch.dtype | None, width: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)])
    optimizer = ZeroOptimizer(model, torch.optim.Adam, stage=stage, compute_dtype=dtype, lr=1e-4)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(hvd.rank()))
    x = x.to(dtype) if dtype is not None else x
    for step in range(2):
        model(x).float().pow(2).mean().backward()
        if step == 1:
            measured = optimizer.memory_report()
        optimizer.step()
        optimizer.zero_grad()
    layout = plan.Layout(dp=hvd.size(), tp=1, pp=1, cp=1, zero=stage, micro_batch=4, micro_batches=1)
    predicted = plan.evaluate(plan.from_module(model), layout, global_batch=4 * hvd.size(),
                              machine=plan.default_machine(),
                              precision=plan.precision("fp32" if dtype is None else "bf16")).memory
    for kind, key in (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer")):
        _close(f"{name}/{kind}", measured[key], getattr(predicted, kind))


def check_gpt(name: str, dp: int, tp: int, pp: int, microbatches: int, recompute: str | None = None,
              sequence_parallel: bool = False, dropout: float = 0.0) -> None:
    config = GPTConfig(vocab_size=len(ALPHABET), sequence_length=32, dim=32, heads=4, layers=2,
                       sequence_parallel=sequence_parallel, recompute=recompute, dropout=dropout)
    grid = ProcessGrid(dp=dp, tp=tp, pp=pp)
    try:
        trainer = build_trainer(config, grid, microbatches=microbatches)
        inputs, targets = batch(DATA, GPT_BATCH, config.sequence_length, torch.Generator().manual_seed(0))
        train_step(trainer, inputs, targets)
        activations = trainer.pipeline.profile.peak_activation_bytes
        params = sum(p.numel() * p.element_size() for p in trainer.stage.parameters())
        stage = grid.coords.pp
    finally:
        grid.free()
    layout = plan.Layout(dp=dp, tp=tp, pp=pp, cp=1, zero=0, micro_batch=GPT_BATCH // dp // microbatches,
                         micro_batches=microbatches, recompute=recompute or "none",
                         sequence_parallel=sequence_parallel)
    predicted = plan.evaluate(plan.from_config(config), layout, global_batch=GPT_BATCH,
                              machine=plan.default_machine(), precision=plan.precision("fp32")).stages[stage]
    # A stage after the first holds the input gradient it sends back until the message is
    # delivered, which may or may not happen before its peak: a race in the measurement.
    in_transit = 0 if stage == 0 else GPT_BATCH // dp // microbatches * config.sequence_length * config.dim * 4
    in_transit //= tp if sequence_parallel else 1
    if in_transit and activations < predicted.activations - in_transit / 2:
        _close(f"{name}/stage{stage}/activations (gradient delivered)", activations,
               predicted.activations - in_transit)
    else:
        _close(f"{name}/stage{stage}/activations", activations, predicted.activations)
    _close(f"{name}/stage{stage}/params", params, predicted.params)


def check_probe(name: str) -> None:
    machine = probe.measure(quick=True)
    assert machine.measured and len(machine.matmul) >= 2 and len(machine.attention) >= 2, machine
    assert all(flops > 1e6 for _, flops in machine.matmul + machine.attention), machine
    assert machine.layer_overhead_s > 0 and machine.tp_layer_overhead_s >= 0 and machine.sp_layer_overhead_s >= 0
    assert machine.elementwise_s_per_byte >= 0 and machine.optimizer_s_per_param > 0, machine
    for link in (machine.engine_allreduce, machine.direct_allreduce, machine.p2p):
        assert link.bandwidth > 1e6 and 0 <= link.latency_s < 1, link
    assert plan.Machine.from_dict(json.loads(machine.to_json())) == machine


GPT_LAYOUTS = [
    ("dp2", {"dp": 2, "tp": 1, "pp": 1, "microbatches": 2}),
    ("tp2", {"dp": 1, "tp": 2, "pp": 1, "microbatches": 2}),
    ("tp2_sequence_parallel", {"dp": 1, "tp": 2, "pp": 1, "microbatches": 2, "sequence_parallel": True}),
    ("tp2_sequence_parallel_selective", {"dp": 1, "tp": 2, "pp": 1, "microbatches": 2, "sequence_parallel": True,
                                         "recompute": "selective"}),
    ("pp2_1f1b", {"dp": 1, "tp": 1, "pp": 2, "microbatches": 4}),
    ("pp2_1f1b_full_recompute", {"dp": 1, "tp": 1, "pp": 2, "microbatches": 4, "recompute": "full"}),
    ("dp2_dropout", {"dp": 2, "tp": 1, "pp": 1, "microbatches": 2, "dropout": 0.1}),
    ("dp2_dropout_selective", {"dp": 2, "tp": 1, "pp": 1, "microbatches": 2, "dropout": 0.1, "recompute": "selective"}),
]


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    checks = _harness.Checks()
    for stage in (0, 1, 2, 3):
        checks.add(f"zero/stage{stage}/fp32/bytes_match_memory_report", check_zero, stage, None, 1024)
        checks.add(f"zero/stage{stage}/bf16/bytes_match_memory_report", check_zero, stage, torch.bfloat16, 256)
    for name, options in GPT_LAYOUTS:
        checks.add(f"gpt/{name}/bytes_match_the_pipeline_profile", lambda check, o=options: check_gpt(check, **o))
    checks.add("probe/measures_a_complete_profile", check_probe)
    _harness.run(checks, check_timeout_s=60.0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
