"""The tiny GPT on 4 ranks laid out as DP × TP × PP in several ways (with 1F1B, GPipe,
interleaving, sequence parallelism, activation recomputation and ZeRO-1 for the DP
part) follows the same loss curve as one process training the same model on the same
global batches, in float64, and ends with the same parameters: the whole single-process
state_dict, from one full_state_dict call on any layout, which load_full_state_dict takes back.
"""
from __future__ import annotations

import functools
import os
import sys

import torch
from torch.nn import functional as F

import _harness
import psrt.torch as hvd
from psrt.full_state import full_state_dict, load_full_state_dict
from psrt.grid import ProcessGrid

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
from tiny_gpt import GPTConfig, batch, build_blocks, build_trainer, corpus, train_step  # noqa: E402

STEPS, ROWS, LR, SEED = 4, 8, 1e-2, 3
DATA, ALPHABET = corpus()


def config(sequence_parallel: bool = False, recompute: str | None = None, experts: int = 0,
           tie: bool = False) -> GPTConfig:
    """Experts route dropless and without the load-balancing loss: both depend on which tokens
    share a forward, and a pipeline's micro-batches are not the one process's whole batch."""
    return GPTConfig(vocab_size=len(ALPHABET), sequence_length=16, dim=16, heads=4, layers=2,
                     sequence_parallel=sequence_parallel, recompute=recompute, experts=experts, tie_embeddings=tie)


def reference_run(cfg: GPTConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(*build_blocks(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    generator, losses = torch.Generator().manual_seed(SEED), []
    for _ in range(STEPS):
        inputs, targets = batch(DATA, ROWS, cfg.sequence_length, generator)
        loss = F.cross_entropy(model(inputs).reshape(-1, cfg.vocab_size), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def check_follows_single_process(key: str, dp: int, tp_size: int, pp_size: int, schedule: str,
                                 sequence_parallel: bool = False, zero: bool = False, chunks: int = 1,
                                 overlap: bool | None = None, recompute: str | None = None, cp: int = 1,
                                 ep: int = 1, experts: int = 0, microbatches: int | None = None,
                                 tie: bool = False) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cfg = config(sequence_parallel, recompute, experts, tie)
        want_losses, want_state = reference_run(config(sequence_parallel, experts=experts, tie=tie))
        grid = ProcessGrid(dp=dp, tp=tp_size, pp=pp_size, cp=cp, ep=ep)
        default = 4 if schedule != "interleaved" else 2
        trainer = build_trainer(cfg, grid, schedule=schedule, microbatches=microbatches or default,
                                chunks=chunks, zero=zero, overlap=overlap, lr=LR, seed=SEED)
        generator, losses = torch.Generator().manual_seed(SEED), []
        for _ in range(STEPS):
            inputs, targets = batch(DATA, ROWS, cfg.sequence_length, generator)
            losses.append(train_step(trainer, inputs, targets))
        got_state = full_state_dict(trainer.stage, grid, trainer.optimizers[0])
        # the inverse: a model built from another seed takes the state back, and gives it again
        fresh = build_trainer(cfg, grid, schedule=schedule, microbatches=microbatches or default, chunks=chunks,
                              lr=LR, seed=SEED + 1).stage
        load_full_state_dict(fresh, got_state)
        again = full_state_dict(fresh, grid)
        grid.free()
    finally:
        torch.set_default_dtype(previous)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-9, atol=1e-12,
                               msg=lambda m: f"loss curve {losses} vs one process {want_losses}: {m}")
    assert sorted(got_state) == sorted(want_state), \
        f"full_state_dict keys differ from one process's: {sorted(set(got_state) ^ set(want_state))[:5]}"
    for name, value in got_state.items():
        # AdamW divides each gradient entry by its own running magnitude, so an entry that is
        # nearly zero (a bias summed in another order) moves by up to about lr x 1e-10 apart
        torch.testing.assert_close(value, want_state[name], rtol=1e-9, atol=1e-10,
                                   msg=lambda m, n=name: f"{n} after {STEPS} steps: {m}")
        assert torch.equal(again[name], value), f"{name} after load_full_state_dict and full_state_dict again"


LAYOUTS = [
    ("dp1_tp2_pp2/1f1b", 1, 2, 2, "1f1b", {}),
    ("dp2_tp1_pp2/gpipe", 2, 1, 2, "gpipe", {}),
    ("dp2_tp2_pp1/1f1b", 2, 2, 1, "1f1b", {}),
    ("dp1_tp1_pp4/1f1b", 1, 1, 4, "1f1b", {}),
    ("dp1_tp2_pp2/1f1b/sequence_parallel", 1, 2, 2, "1f1b", {"sequence_parallel": True}),
    ("dp2_tp2_pp1/zero1", 2, 2, 1, "1f1b", {"zero": True}),
    ("dp2_tp1_pp2/interleaved_v2", 2, 1, 2, "interleaved", {"chunks": 2}),
    # the engine all-reduces gradients during the last backward while TP and PP traffic runs
    ("dp2_tp2_pp1/overlapped_allreduce", 2, 2, 1, "1f1b", {"overlap": True}),
    ("dp2_tp1_pp2/overlapped_allreduce", 2, 1, 2, "1f1b", {"overlap": True}),
    ("dp1_tp2_pp2/interleaved_v2/sequence_parallel", 1, 2, 2, "interleaved", {"chunks": 2, "sequence_parallel": True}),
    ("dp1_tp2_pp2/1f1b/recompute_full", 1, 2, 2, "1f1b", {"recompute": "full"}),
    ("dp2_tp2_pp1/1f1b/recompute_selective/sequence_parallel", 2, 2, 1, "1f1b",
     {"recompute": "selective", "sequence_parallel": True}),
    ("dp1_tp2_pp2/zb-h1/sequence_parallel", 1, 2, 2, "zb-h1", {"sequence_parallel": True}),
    ("dp2_tp1_pp2/zb-h1/overlapped_allreduce", 2, 1, 2, "zb-h1", {"overlap": True}),
    # a split backward recomputes a block twice (input half, then weight half), masks replayed both times
    ("dp1_tp2_pp2/zb-h1/recompute_full", 1, 2, 2, "zb-h1", {"recompute": "full"}),
    # context parallelism: ring attention over zig-zag parts of every sequence
    ("dp1_tp1_pp2_cp2/1f1b", 1, 1, 2, "1f1b", {"cp": 2}),
    ("dp2_tp1_pp1_cp2/1f1b", 2, 1, 1, "1f1b", {"cp": 2}),
    ("dp1_tp2_pp1_cp2/1f1b/sequence_parallel", 1, 2, 1, "1f1b", {"cp": 2, "sequence_parallel": True}),
    # expert parallelism: the MLPs are 4-expert MoEs, experts over EP (inside DP), split over TP
    ("dp2_tp1_pp2_ep2/1f1b", 2, 1, 2, "1f1b", {"ep": 2, "experts": 4}),
    ("dp2_tp2_pp1_ep2/1f1b", 2, 2, 1, "1f1b", {"ep": 2, "experts": 4}),
    ("dp4_tp1_pp1_ep2/1f1b", 4, 1, 1, "1f1b", {"ep": 2, "experts": 4, "microbatches": 2}),
    # tied input and output embeddings on the first and the last stage
    ("dp1_tp2_pp2/1f1b/tied_embeddings", 1, 2, 2, "1f1b", {"tie": True}),
    ("dp2_tp1_pp2/zb-h1/tied_embeddings/overlapped_allreduce", 2, 1, 2, "zb-h1", {"tie": True, "overlap": True}),
    ("dp1_tp1_pp4/gpipe/tied_embeddings", 1, 1, 4, "gpipe", {"tie": True}),
    ("dp2_tp1_pp2/interleaved_v2/tied_embeddings/zero1", 2, 1, 2, "interleaved",
     {"tie": True, "chunks": 2, "zero": True}),
]


def main() -> None:
    hvd.init()
    checks = _harness.Checks()
    for name, dp, tp_size, pp_size, schedule, options in LAYOUTS:
        checks.add(f"gpt/{name}", functools.partial(check_follows_single_process, **options), dp, tp_size, pp_size,
                   schedule)
    _harness.run(checks, check_timeout_s=60.0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
