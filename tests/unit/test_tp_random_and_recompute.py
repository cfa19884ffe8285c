"""The random-stream tracker, the dropouts built on it and activation recomputation, in
one process (the TP-group behaviour is in tests/parallel/scripts/tp_check.py)."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from psrt import tp
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.tp import random as tp_random


@pytest.fixture(autouse=True)
def fresh_tracker():
    tp.rng_tracker().reset()
    yield
    tp.rng_tracker().reset()


def test_a_fork_draws_from_its_stream_and_leaves_the_default_generator_alone():
    tp.manual_seed(7)
    with tp.rng_tracker().fork():
        inside = torch.rand(8)
    outside = torch.rand(8)
    torch.manual_seed(7 + tp_random.TENSOR_PARALLEL_SEED_OFFSET)
    assert torch.equal(inside, torch.rand(8))
    torch.manual_seed(7)
    assert torch.equal(outside, torch.rand(8))


def test_a_stream_continues_where_its_last_fork_ended():
    tp.manual_seed(7)
    with tp.rng_tracker().fork():
        first = torch.rand(4)
    with tp.rng_tracker().fork():
        second = torch.rand(4)
    torch.manual_seed(7 + tp_random.TENSOR_PARALLEL_SEED_OFFSET)
    assert torch.equal(torch.cat([first, second]), torch.rand(8))


def test_states_round_trip():
    tp.manual_seed(3)
    saved = tp.rng_tracker().get_states()
    with tp.rng_tracker().fork():
        first = torch.rand(4)
    tp.rng_tracker().set_states(saved)
    with tp.rng_tracker().fork():
        assert torch.equal(torch.rand(4), first)


def test_tracker_errors_name_the_problem():
    tracker = tp.rng_tracker()
    with pytest.raises(InvalidArgumentError, match="call psrt.tp.manual_seed"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(InvalidArgumentError, match="'a' already exists"):
        tracker.add("a", 2)
    with pytest.raises(InvalidArgumentError, match="seed 1 is already used"):
        tracker.add("b", 1)
    with pytest.raises(ArgumentTypeError, match="must be an int, got str"):
        tracker.add("c", "1")
    with pytest.raises(InvalidArgumentError, match="no random stream named 'z'"):
        tracker.set_states({"z": {}})


def test_dropout_draws_the_mask_torch_dropout_draws():
    x = torch.randn(4, 6, dtype=torch.float64)
    torch.manual_seed(5)
    want = F.dropout(x, 0.3)
    torch.manual_seed(5)
    got = tp.replicated_dropout(x, 0.3, None, sequence_parallel=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    assert tp.replicated_dropout(x, 0.3, None, sequence_parallel=False, training=False) is x
    with pytest.raises(InvalidArgumentError, match=r"must lie in \[0, 1\), got 1.5"):
        tp.tensor_parallel_dropout(x, 1.5, None)


def run_block(recompute, dtype=torch.float64):
    """Forward and backward of a block with every dropout on, from one seed."""
    tp.manual_seed(3)
    block = tp.ParallelTransformerBlock(16, 4, dropout=0.2, attention_dropout=0.3, recompute=recompute).to(dtype)
    x = torch.randn(2, 8, 16, dtype=dtype, requires_grad=True)
    out = block(x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, [p.grad for p in block.parameters()], torch.get_rng_state(), \
        tp.rng_tracker().get_states()[tp_random.TENSOR_PARALLEL_STREAM]["cpu"]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_replays_every_mask(mode):
    want, got = run_block(None), run_block(mode)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    assert torch.equal(got[3], want[3]) and torch.equal(got[4], want[4]), "streams end in a different place"


def test_recomputation_without_the_tracker_replay_would_differ(monkeypatch):
    """The check above can fail: without replaying the tracker the attention masks differ."""
    from torch.utils.checkpoint import noop_context_fn
    want = run_block(None)
    monkeypatch.setattr(tp.recompute, "_tracker_contexts", noop_context_fn)
    assert not torch.equal(run_block("selective")[1], want[1])


def test_recomputation_keeps_fewer_bytes():
    def kept(recompute):
        tp.manual_seed(0)
        block = tp.ParallelTransformerBlock(32, 4, dropout=0.1, attention_dropout=0.1, recompute=recompute)
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(torch.randn(2, 64, 32, requires_grad=True))
        return sum(seen.values())

    none, selective, full = kept(None), kept("selective"), kept("full")
    assert full < selective < none, (none, selective, full)


def test_no_recomputation_without_gradients():
    tp.manual_seed(0)
    block = tp.ParallelTransformerBlock(16, 4, recompute="full").eval()
    with torch.no_grad():
        assert block(torch.randn(1, 4, 16)).shape == (1, 4, 16)
