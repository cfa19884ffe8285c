"""Context parallelism over all ranks of the job (CP = 2 or 4, and CP 2 × TP 2 at 4 ranks):
ring attention against full attention in one process, forward and every gradient in
float64, causal (zig-zag) and not; a transformer block with CP and TP against the
single-process block; the grid's CP sets; and the errors a user can trigger.
"""
from __future__ import annotations

import torch

import _harness
import psrt.torch as hvd
from _training_common import expect_raises, randn
from psrt import cp, tp
from psrt.errors import InvalidArgumentError
from psrt.grid import ProcessGrid

BATCH, HEADS, HEAD_DIM, DIM = 2, 4, 8, 16


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def mine(tensor: torch.Tensor, dim: int, causal: bool, process_set) -> torch.Tensor:
    """This rank's part of a whole-sequence tensor: zig-zag for causal attention, a plain block otherwise."""
    rank, size = process_set.rank(), process_set.size()
    return cp.split(tensor, dim, rank, size) if causal else tensor.chunk(size, dim)[rank]


def check_ring_attention(key: str, causal: bool, length: int) -> None:
    """Output and the gradients of q, k and v equal full attention's parts."""
    process_set = grid().cp_set
    full = [randn(key, (BATCH, HEADS, length, HEAD_DIM), name).requires_grad_() for name in "qkv"]
    weights = randn(key, (BATCH, HEADS, length, HEAD_DIM), "R")
    want = torch.nn.functional.scaled_dot_product_attention(*full, is_causal=causal)
    (want * weights).sum().backward()
    parts = [mine(t.detach(), 2, causal, process_set).requires_grad_() for t in full]
    cp.stats().reset()
    got = cp.ring_attention(*parts, process_set, causal=causal)
    (got * mine(weights, 2, causal, process_set)).sum().backward()
    close(got.detach(), mine(want.detach(), 2, causal, process_set), "output")
    for name, part, whole in zip("qkv", parts, full):
        close(part.grad, mine(whole.grad, 2, causal, process_set), f"gradient of {name}")
    size = process_set.size()
    # forward: size - 1 hops of k/v; backward: size - 1 hops of k/v with their gradients, one to bring them home
    assert cp.stats().counts["hop"] == 2 * (size - 1) + 1, f"{dict(cp.stats().counts)} hops at CP {size}"


def check_block_with_cp_and_tp(key: str) -> None:
    """A transformer block with its heads over TP and its sequence over CP equals the block in one process."""
    g = grid(cp_and_tp=True)
    length = 8 * g.shape.cp
    torch.manual_seed(3)
    reference = tp.ParallelTransformerBlock(DIM, HEADS).double()
    block = tp.ParallelTransformerBlock(DIM, HEADS, process_set=g.tp_set, context_parallel=g.cp_set).double()
    tp.load_full_state_dict(block, reference.state_dict())
    x = randn(key, (BATCH, length, DIM), "x").requires_grad_()
    weights = randn(key, (BATCH, length, DIM), "R")
    want = reference(x)
    (want * weights).sum().backward()
    x_mine = mine(x.detach(), 1, True, g.cp_set).requires_grad_()
    got = block(x_mine)
    (got * mine(weights, 1, True, g.cp_set)).sum().backward()
    close(got.detach(), mine(want.detach(), 1, True, g.cp_set), "block output")
    close(x_mine.grad, mine(x.grad, 1, True, g.cp_set), "block input gradient")
    grads = {name: p.grad for name, p in reference.named_parameters()}
    for name, param in block.named_parameters():
        # each CP rank holds its tokens' share of a parameter gradient: summed over CP they are the whole
        total = hvd.allreduce(param.grad, op=hvd.Sum, name=f"{key}.{name}", process_set=g.cp_set)
        sharding = tp.sharding.sharding_of(param)
        close(total, grads[name] if sharding is None else sharding.shard(grads[name]), f"gradient of {name}")


def check_grid_sets(key: str) -> None:
    """TP innermost, then CP: the CP set holds ranks tp apart, DP × CP every rank with the same TP and PP."""
    n = hvd.size()
    g = grid()
    assert g.cp_set.size() == n and g.cp_set.rank() == hvd.rank() == g.coords.cp, f"CP set of {g}"
    assert g.dp_cp_set.size() == n, "the DP × CP set is the whole CP set when dp = 1"
    if n == 4:
        both = grid(cp_and_tp=True)
        assert (both.coords.tp, both.coords.cp) == (hvd.rank() % 2, hvd.rank() // 2), repr(both)
        assert both.cp_set.size() == 2 and both.tp_set.size() == 2
    plain = ProcessGrid(dp=n)
    assert plain.cp_set is None and plain.dp_cp_set is plain.dp_set, "no CP sets without context parallelism"
    plain.free()


def check_errors(key: str) -> None:
    """Each ends in the same clear error on every rank, before any block moves."""
    n = hvd.size()
    g = grid()
    expect_raises(InvalidArgumentError, lambda: cp.split(torch.zeros(1, 2 * n + 2), 1, g.coords.cp, n),
                  f"a sequence of {2 * n + 2} tokens does not split over context-parallel size {n}", "odd sequence")
    tokens = 4 if hvd.rank() == n - 1 else 2  # the last rank holds more tokens than the others
    q = randn(key, (BATCH, HEADS, tokens, HEAD_DIM), "q")
    expect_raises(InvalidArgumentError, lambda: cp.ring_attention(q, q, q, g.cp_set),
                  f"context-parallel ranks disagree: rank 0 has q ({BATCH}, {HEADS}, 2, {HEAD_DIM})", "token counts")
    expect_raises(InvalidArgumentError, lambda: tp.ParallelSelfAttention(DIM, HEADS, context_parallel=g.cp_set,
                                                                         attention_dropout=0.1),
                  "attention_dropout is not supported with context parallelism", "CP with attention dropout")
    expect_raises(InvalidArgumentError, lambda: ProcessGrid(dp=1, cp=n, tp=2),
                  f"dp × cp × tp × pp = 1 × {n} × 2 × 1 = {2 * n} does not match the {n} ranks", "too large a grid")
    # the group still works afterwards
    check_ring_attention(key + "/after", True, 4 * n)


_GRIDS: dict[bool, ProcessGrid] = {}


def grid(cp_and_tp: bool = False) -> ProcessGrid:
    if cp_and_tp not in _GRIDS:
        n = hvd.size()
        _GRIDS[cp_and_tp] = ProcessGrid(cp=n // 2, tp=2) if cp_and_tp else ProcessGrid(cp=n)
    return _GRIDS[cp_and_tp]


def main() -> None:
    hvd.init()
    grid()
    if hvd.size() == 4:
        grid(cp_and_tp=True)
    checks = _harness.Checks()
    checks.add("grid/cp_sets", check_grid_sets)
    n = hvd.size()
    for causal in (True, False):
        for length in (2 * n, 8 * n):
            checks.add(f"ring/{'causal' if causal else 'full'}/tokens{length}", check_ring_attention, causal, length)
    if n == 4:
        checks.add("block/cp2_tp2_matches_one_process", check_block_with_cp_and_tp)
    checks.add("errors/bad_sequences_and_layouts", check_errors)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
