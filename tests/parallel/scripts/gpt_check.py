"""The tiny GPT on 4 ranks laid out as DP × TP × PP in several ways (with 1F1B, GPipe,
interleaving, sequence parallelism, activation recomputation and ZeRO-1 for the DP
part) follows the same loss curve as one process training the same model on the same
global batches, in float64, and ends with the same parameters: the whole single-process
state_dict, from one full_state_dict call on any layout, which load_full_state_dict takes back.
An elastic commit of the GPT (its own blocks per rank) restores on another layout to the
same model and optimizer state, with experts and tied embeddings, and no rank's memory grows
by more than its own part of the model and optimizer (plus the largest tensor) while it
commits or restores.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import re
import shutil
import sys
import tempfile

import torch
from torch.nn import functional as F

import _harness
import psrt.torch as hvd
from launcher.contract import ENV_ELASTIC_DIR
from psrt import pp, tp
from psrt.full_state import full_optimizer_state_dict, full_state_dict, load_full_state_dict
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


@contextlib.contextmanager
def elastic_directory():
    """A commit directory every rank sees, named to the elastic states made inside."""
    directory = hvd.broadcast_object(tempfile.mkdtemp(prefix="psrt-gpt-commit-") if hvd.rank() == 0 else None,
                                     root_rank=0, name="gpt_check.directory")
    os.environ[ENV_ELASTIC_DIR] = directory
    try:
        yield
    finally:
        del os.environ[ENV_ELASTIC_DIR]
        hvd.allgather_object(None, name="gpt_check.restored")
        if hvd.rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)


def stepped_state(cfg: GPTConfig, layout: tuple[int, int, int, int], seed: int):
    """The GPT's stage on ``layout`` (dp, tp, pp, ep) with AdamW state from one step on the
    gradient sin(parameter), the same entry for entry on every layout, in a TorchState."""
    dp, tp_size, pp_size, ep = layout
    grid = ProcessGrid(dp=dp, tp=tp_size, pp=pp_size, ep=ep)
    tp.manual_seed(seed, grid.tp_set)
    stage = pp.PipelineStage(build_blocks(cfg, grid.tp_set, grid.cp_set, grid.ep_set), grid.pp_set)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=LR)
    for param in stage.parameters():
        param.grad = param.detach().sin()
    optimizer.step()
    return grid, stage, optimizer, hvd.elastic.TorchState(stage, optimizer, grid=grid)


def _resident_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+) kB", status.read()).group(1))


@contextlib.contextmanager
def tensors_mapped_on_their_own():
    """Inside, every allocation of 64 KiB or more (each tensor of the model and optimizer) is a
    mapping of its own, returned to the system when freed, so resident memory follows what the
    code holds rather than what the allocator kept from earlier checks (glibc's M_MMAP_THRESHOLD;
    set back to its initial 128 KiB after)."""
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, 64 << 10)
    try:
        yield
    finally:
        libc.mallopt(-3, 128 << 10)


def peak_growth(function) -> int:
    """How many bytes this rank's peak resident memory rose above its resident memory before
    ``function()`` ran (the peak is reset first)."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # freed memory back to the system: none of it is reused unseen
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the peak (VmHWM) starts again from what is resident now
    before = _resident_kib("VmRSS")
    function()
    return (_resident_kib("VmHWM") - before) * 1024


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def held_bytes(stage: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's part of the model and optimizer state."""
    return _bytes([*stage.state_dict().values(),
                   *(v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))])


def check_sharded_commit_moves_between_layouts(key: str, saved_on: tuple, restored_on: tuple, dim: int = 16,
                                               experts: int = 0, tie: bool = False, memory: bool = False) -> None:
    """Committed on ``saved_on`` and restored, by a state whose model was drawn from another
    seed, on ``restored_on`` (dp, tp, pp, ep): the restored model and optimizer state are the
    committed ones, entry for entry.  With ``memory``, each rank's peak memory grows by at most
    its own part of the model and optimizer plus the largest tensor (and 2 MiB) while it
    commits and while it restores, which is well under the whole model and optimizer."""
    cfg = GPTConfig(vocab_size=len(ALPHABET), sequence_length=16, dim=dim, heads=4, layers=4 if memory else 2,
                    experts=experts, tie_embeddings=tie)
    with elastic_directory(), tensors_mapped_on_their_own() if memory else contextlib.nullcontext():
        grid, stage, optimizer, state = stepped_state(cfg, saved_on, SEED)
        committing = peak_growth(state.commit)
        saved_bytes = held_bytes(stage, optimizer)
        want = full_state_dict(stage, grid), full_optimizer_state_dict(stage, optimizer, grid)
        grid.free()
        grid, stage, optimizer, state = stepped_state(cfg, restored_on, SEED + 1)
        restoring = peak_growth(state._resume)
        restored_bytes = held_bytes(stage, optimizer)
        got = full_state_dict(stage, grid), full_optimizer_state_dict(stage, optimizer, grid)
        grid.free()
    assert state.restored_from == 1, f"restored from commit {state.restored_from}"
    assert sorted(got[0]) == sorted(want[0]) and sorted(got[1]["state"]) == sorted(want[1]["state"])
    for name, value in want[0].items():
        assert torch.equal(got[0][name], value), f"{name} restored on {restored_on} differs from {saved_on}'s"
    for name, entry in want[1]["state"].items():
        for part, value in entry.items():
            assert torch.equal(got[1]["state"][name][part], value), f"optimizer state {part} of {name} differs"
    if memory:
        whole = _bytes([*want[0].values(), *(v for e in want[1]["state"].values() for v in e.values())])
        largest = max(v.numel() * v.element_size() for v in want[0].values())
        for what, grown, own in (("commit", committing, saved_bytes), ("restore", restoring, restored_bytes)):
            bound = own + largest + (2 << 20)  # 2 MiB for the index, the readers and the allocator
            print(f"{key}: rank {hvd.rank()} {what} grew {grown / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB "
                  f"(own part {own / 2**20:.1f}, largest tensor {largest / 2**20:.1f}), whole "
                  f"{whole / 2**20:.1f} MiB", file=sys.stderr, flush=True)
            assert bound < 0.6 * whole, f"the model is too small for the {what} bound to say anything"
            assert grown <= bound, (f"peak memory grew by {grown} bytes in the {what}, above this rank's part "
                                    f"{own} + the largest tensor {largest} (+2 MiB); the whole is {whole}")


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
    # experts move from EP 2 to EP 1 and TP 1 to TP 2, the tied embedding from two stages to one
    checks.add("checkpoint/sharded_commit/dp2_tp1_pp2_ep2_to_dp2_tp2_pp1/experts/tied_embeddings",
               functools.partial(check_sharded_commit_moves_between_layouts, experts=4, tie=True),
               (2, 1, 2, 2), (2, 2, 1, 1))
    checks.add("checkpoint/sharded_commit/dp1_tp2_pp2_to_dp1_tp4_pp1/memory",
               functools.partial(check_sharded_commit_moves_between_layouts, dim=256, memory=True),
               (1, 2, 2, 1), (1, 4, 1, 1))
    _harness.run(checks, check_timeout_s=60.0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
