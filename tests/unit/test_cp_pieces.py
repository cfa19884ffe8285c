"""Context parallelism's pieces in one process: zig-zag placement and its errors (ring
attention across ranks is in tests/parallel/scripts/cp_check.py)."""
from __future__ import annotations

import pytest
import torch

from psrt import cp
from psrt.errors import ArgumentTypeError, InvalidArgumentError


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_zigzag_parts_pair_early_and_late_chunks_and_unsplit_restores_the_sequence(size):
    sequence = torch.arange(4 * size * 3).reshape(1, -1)
    parts = [cp.split(sequence, 1, rank, size) for rank in range(size)]
    assert torch.equal(cp.unsplit(parts, 1), sequence)
    chunk = sequence.shape[1] // (2 * size)
    for rank, part in enumerate(parts):
        assert torch.equal(part[0], cp.positions(sequence.shape[1], rank, size))
        first, second = part[0, :chunk], part[0, chunk:]
        assert int(first[0]) == rank * chunk and int(second[0]) == (2 * size - 1 - rank) * chunk
    # under a causal mask every rank's queries see the same number of keys
    work = [int(sum(cp.positions(sequence.shape[1], rank, size) + 1)) for rank in range(size)]
    assert len(set(work)) == 1, work


def test_a_sequence_the_group_does_not_split_is_refused():
    with pytest.raises(InvalidArgumentError, match="a sequence of 10 tokens does not split over context-parallel "
                                                   "size 2: .* a multiple of 4"):
        cp.split(torch.zeros(1, 10), 1, 0, 2)


def test_ring_attention_without_a_group_is_causal_attention():
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64) for _ in range(3))
    want = torch.softmax((q @ k.transpose(-2, -1)) / 2 + torch.full((8, 8), float("-inf")).triu(1), -1) @ v
    torch.testing.assert_close(cp.ring_attention(q, k, v, None), want)


def test_ring_attention_refuses_bad_shapes():
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ArgumentTypeError, match=r"q must be a \[batch, heads, tokens, head_dim\] tensor"):
        cp.ring_attention(q[0], q, q, None)
    with pytest.raises(InvalidArgumentError, match="do not fit one attention"):
        cp.ring_attention(q, q, torch.zeros(1, 2, 4, 6), None)
    odd = torch.randn(1, 2, 3, 8)  # without a group any length is fine
    assert cp.ring_attention(odd, odd, odd, None).shape == (1, 2, 3, 8)


@pytest.mark.parametrize("diagonal", [False, True])
def test_the_fused_block_kernels_and_the_plain_torch_ones_agree(diagonal, monkeypatch):
    """Ring attention's block math runs torch's fused CPU flash kernels where they apply and
    plain torch elsewhere (CUDA); both give the same output, log-sum-exp and gradient shares."""
    from psrt.cp import ring
    generator = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(2, 3, 6, 4, dtype=torch.float64, generator=generator) for _ in range(4))
    fused_out, fused_lse = ring._block_forward(q, k, v, 0.5, diagonal)
    delta = (grad * fused_out).sum(-1)
    fused_grads = ring._block_backward(grad, q, k, v, fused_out, fused_lse, delta, 0.5, diagonal)
    monkeypatch.setattr(ring, "_fused", lambda q: False)
    out, lse = ring._block_forward(q, k, v, 0.5, diagonal)
    torch.testing.assert_close(out, fused_out)
    torch.testing.assert_close(lse, fused_lse)
    for plain, fused in zip(ring._block_backward(grad, q, k, v, out, lse, delta, 0.5, diagonal), fused_grads):
        torch.testing.assert_close(plain, fused)
