"""Tensor parallelism over all ranks of the job (TP = 2 or 4): every layer against its
torch.nn equivalent in one process, with and without sequence parallelism; the
number of collectives per layer; full state_dicts in and out; the process grid;
bad layouts and mismatched inputs; the random streams of dropout (the masks
themselves) and activation recomputation against the same block without it.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn import functional as F

import _harness
import psrt.torch as hvd
from _training_common import expect_raises, generator, randn
from psrt import tp
from psrt.tp import random as tp_random
from psrt.errors import ArgumentTypeError, CollectiveMismatchError, InvalidArgumentError
from psrt.grid import ProcessGrid
from psrt.pp.split_backward import backward_input

BATCH, SEQ, DIM, HEADS, VOCAB = 2, 8, 16, 4, 37  # VOCAB is divisible by neither 2 nor 4


def block_of(tensor: torch.Tensor, dim: int, parts: int) -> torch.Tensor:
    return tensor.chunk(parts, dim)[hvd.rank()]


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def with_input(key: str, shape, sequence_parallel: bool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full input (for the reference) and this rank's input, both leaves."""
    full = randn(key, shape, "x").requires_grad_()
    mine = block_of(full.detach(), 1, n) if sequence_parallel else full.detach()
    return full, mine.clone().requires_grad_()


def run_both(key: str, module: nn.Module, reference: nn.Module, x_full, x_mine, out_split: int | None,
             sequence_parallel: bool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of ``loss = sum(out * R)`` on both; returns the two outputs, after
    checking them, the input gradients, and every parameter gradient block by block."""
    ref_out = reference(x_full)
    weights = randn(key, ref_out.shape, "R")
    (ref_out * weights).sum().backward()
    out = module(x_mine)
    mine_weights = weights
    if sequence_parallel:
        mine_weights = block_of(mine_weights, 1, n)
    if out_split is not None:
        mine_weights = block_of(mine_weights, out_split, n)
    (out * mine_weights).sum().backward()
    want = ref_out.detach()
    if sequence_parallel:
        want = block_of(want, 1, n)
    if out_split is not None:
        want = block_of(want, out_split, n)
    close(out.detach(), want, "output")
    close(x_mine.grad, block_of(x_full.grad, 1, n) if sequence_parallel else x_full.grad, "input gradient")
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    for name, param in module.named_parameters():
        sharding = tp.sharding.sharding_of(param)
        want = reference_grads[name] if sharding is None else sharding.shard(reference_grads[name])
        close(param.grad, want, f"gradient of {name}")
    return out, ref_out


def check_column(key: str, gather_output: bool, sequence_parallel: bool) -> None:
    torch.manual_seed(generator(key).initial_seed())
    n, ps = hvd.size(), grid().tp_set
    reference = nn.Linear(DIM, 3 * DIM).double()
    layer = tp.ColumnParallelLinear(DIM, 3 * DIM, process_set=ps, gather_output=gather_output,
                                    sequence_parallel=sequence_parallel).double()
    tp.load_full_state_dict(layer, reference.state_dict())
    x_full, x_mine = with_input(key, (BATCH, SEQ, DIM), sequence_parallel, n)
    run_both(key, layer, reference, x_full, x_mine, None if gather_output else -1, False, n) \
        if not sequence_parallel else _column_sequence_parallel(key, layer, reference, x_full, x_mine, n)


def _column_sequence_parallel(key, layer, reference, x_full, x_mine, n) -> None:
    """The input arrives split along the sequence; the output is whole along it."""
    ref_out = reference(x_full)
    weights = randn(key, ref_out.shape, "R")
    (ref_out * weights).sum().backward()
    out = layer(x_mine)
    (out * block_of(weights, -1, n)).sum().backward()
    close(out.detach(), block_of(ref_out.detach(), -1, n), "output")
    close(x_mine.grad, block_of(x_full.grad, 1, n), "input gradient")
    close(layer.weight.grad, layer.weight.tp_sharding.shard(reference.weight.grad), "weight gradient")


def check_row(key: str, input_is_parallel: bool, sequence_parallel: bool) -> None:
    torch.manual_seed(generator(key).initial_seed())
    n, ps = hvd.size(), grid().tp_set
    reference = nn.Linear(3 * DIM, DIM).double()
    layer = tp.RowParallelLinear(3 * DIM, DIM, process_set=ps, input_is_parallel=input_is_parallel,
                                 sequence_parallel=sequence_parallel).double()
    tp.load_full_state_dict(layer, reference.state_dict())
    x_full = randn(key, (BATCH, SEQ, 3 * DIM), "x").requires_grad_()
    x_mine = (block_of(x_full.detach(), -1, n) if input_is_parallel else x_full.detach()).clone().requires_grad_()
    ref_out = reference(x_full)
    weights = randn(key, ref_out.shape, "R")
    (ref_out * weights).sum().backward()
    out = layer(x_mine)
    (out * (block_of(weights, 1, n) if sequence_parallel else weights)).sum().backward()
    close(out.detach(), block_of(ref_out.detach(), 1, n) if sequence_parallel else ref_out.detach(), "output")
    close(x_mine.grad, block_of(x_full.grad, -1, n) if input_is_parallel else x_full.grad, "input gradient")
    close(layer.weight.grad, layer.weight.tp_sharding.shard(reference.weight.grad), "weight gradient")
    close(layer.bias.grad, reference.bias.grad, "bias gradient (summed over the sequence blocks)")


def check_embedding(key: str, sequence_parallel: bool) -> None:
    torch.manual_seed(generator(key).initial_seed())
    n, ps = hvd.size(), grid().tp_set
    reference = nn.Embedding(VOCAB, DIM).double()
    layer = tp.VocabParallelEmbedding(VOCAB, DIM, process_set=ps, sequence_parallel=sequence_parallel).double()
    assert layer.weight.shape[0] * n >= VOCAB and layer.weight.shape[0] * n - VOCAB < n, "vocabulary padding"
    tp.load_full_state_dict(layer, reference.state_dict())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(5))
    ids[0, :2] = torch.tensor([VOCAB - 1, 0])  # the last real row lives next to the padding
    ref_out = reference(ids)
    weights = randn(key, ref_out.shape, "R")
    (ref_out * weights).sum().backward()
    out = layer(ids)
    (out * (block_of(weights, 1, n) if sequence_parallel else weights)).sum().backward()
    close(out.detach(), block_of(ref_out.detach(), 1, n) if sequence_parallel else ref_out.detach(), "output")
    close(layer.weight.grad, layer.weight.tp_sharding.shard(reference.weight.grad), "weight gradient")
    full = tp.full_state_dict(layer, ps)
    assert full["weight"].shape == (VOCAB, DIM), f"gathered weight has shape {tuple(full['weight'].shape)}"
    close(full["weight"], reference.weight.detach(), "gathered weight")


def check_cross_entropy(key: str) -> None:
    """A padded vocab-parallel head and cross-entropy equal nn.Linear + F.cross_entropy, with
    exactly three all-reduces forward and none backward."""
    n, ps = hvd.size(), grid().tp_set
    torch.manual_seed(generator(key).initial_seed())
    reference = nn.Linear(DIM, VOCAB).double()
    head = tp.ColumnParallelLinear(DIM, VOCAB, process_set=ps, pad_out_features=True).double()
    tp.load_full_state_dict(head, reference.state_dict())
    x_full, x_mine = with_input(key, (BATCH, SEQ, DIM), False, n)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(6))
    targets[0, 0] = VOCAB - 1
    ref_loss = F.cross_entropy(reference(x_full).reshape(-1, VOCAB), targets.reshape(-1))
    ref_loss.backward()
    logits = head(x_mine)
    tp.stats().reset()
    loss = tp.vocab_parallel_cross_entropy(logits, targets, ps, vocab_size=VOCAB)
    forward_counts = dict(tp.stats().counts)
    tp.stats().reset()
    loss.backward()
    close(loss.detach(), ref_loss.detach(), "loss")
    close(x_mine.grad, x_full.grad, "input gradient")
    close(head.weight.grad, head.weight.tp_sharding.shard(reference.weight.grad), "head weight gradient")
    assert forward_counts == {"all_reduce": 3}, f"cross-entropy forward ran {forward_counts}"
    # the head's input copy is the only collective of the backward
    assert dict(tp.stats().counts) == {"all_reduce": 1}, f"backward ran {dict(tp.stats().counts)}"


class ReferenceAttention(nn.Module):
    """Causal self-attention from torch.nn.MultiheadAttention (fused in-projection = our qkv)."""

    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, x):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


def attention_state(reference: ReferenceAttention, prefix: str = "") -> dict:
    mha = reference.mha
    return {f"{prefix}qkv.weight": mha.in_proj_weight, f"{prefix}qkv.bias": mha.in_proj_bias,
            f"{prefix}out.weight": mha.out_proj.weight, f"{prefix}out.bias": mha.out_proj.bias}


class ReferenceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(DIM), ReferenceAttention(), nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def psrt_state(self) -> dict:
        state = {f"{ln}.{p}": getattr(getattr(self, ln), p) for ln in ("ln1", "ln2") for p in ("weight", "bias")}
        state.update(attention_state(self.attn, "attn."))
        for ours, theirs in (("fc1", "0"), ("fc2", "2")):
            state.update({f"mlp.{ours}.{p}": getattr(self.mlp[int(theirs)], p) for p in ("weight", "bias")})
        return {k: v.detach() for k, v in state.items()}

    def psrt_grads(self) -> dict:
        """Gradients under psrt's parameter names."""
        names = {id(v): k for k, v in self._named_state().items()}
        return {names[id(p)]: p.grad for p in self.parameters()}

    def _named_state(self) -> dict:
        state = {f"{ln}.{p}": getattr(getattr(self, ln), p) for ln in ("ln1", "ln2") for p in ("weight", "bias")}
        state.update(attention_state(self.attn, "attn."))
        for ours, theirs in (("fc1", 0), ("fc2", 2)):
            state.update({f"mlp.{ours}.{p}": getattr(self.mlp[theirs], p) for p in ("weight", "bias")})
        return state


COUNTS = {False: {"all_reduce": 4}, True: {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 4}}


def check_block(key: str, part: str, sequence_parallel: bool) -> None:
    """MLP, attention or a whole block equals its torch.nn reference, and a whole block runs
    the designed collectives: 4 all-reduces, or 4 all-gathers + 4 reduce-scatters (+ 4 small
    all-reduces of LayerNorm and bias gradients) with sequence parallelism."""
    n, ps = hvd.size(), grid().tp_set
    torch.manual_seed(11)
    whole = ReferenceBlock().double()
    options = dict(process_set=ps, sequence_parallel=sequence_parallel)
    if part == "mlp":
        module, reference, prefix = tp.ParallelMLP(DIM, 4 * DIM, **options), whole.mlp, "mlp."
    elif part == "attention":
        module, reference, prefix = tp.ParallelSelfAttention(DIM, HEADS, **options), whole.attn, "attn."
    else:
        module, reference, prefix = tp.ParallelTransformerBlock(DIM, HEADS, **options), whole, ""
    module.double()
    state = {k[len(prefix):]: v for k, v in whole.psrt_state().items() if k.startswith(prefix)}
    tp.load_full_state_dict(module, state)
    x_full, x_mine = with_input(key, (BATCH, SEQ, DIM), sequence_parallel, n)
    ref_out = reference(x_full)
    weights = randn(key, ref_out.shape, "R")
    (ref_out * weights).sum().backward()
    tp.stats().reset()
    out = module(x_mine)
    (out * (block_of(weights, 1, n) if sequence_parallel else weights)).sum().backward()
    counts = dict(tp.stats().counts)
    close(out.detach(), block_of(ref_out.detach(), 1, n) if sequence_parallel else ref_out.detach(), "output")
    close(x_mine.grad, block_of(x_full.grad, 1, n) if sequence_parallel else x_full.grad, "input gradient")
    grads = {k[len(prefix):]: v for k, v in whole.psrt_grads().items() if k.startswith(prefix)}
    for name, param in module.named_parameters():
        sharding = tp.sharding.sharding_of(param)
        close(param.grad, grads[name] if sharding is None else sharding.shard(grads[name]), f"gradient of {name}")
    if part == "block":
        assert counts == COUNTS[sequence_parallel], f"a block ran {counts}, expected {COUNTS[sequence_parallel]}"
        gathered = tp.full_state_dict(module, ps)
        for name, value in whole.psrt_state().items():
            assert torch.equal(gathered[name], value), f"full_state_dict: {name} differs from the loaded state"


def check_grid(key: str) -> None:
    n = hvd.size()
    g = grid()
    assert (g.coords.dp, g.coords.tp, g.coords.pp) == (0, hvd.rank(), 0), f"coordinates {g.coords}"
    assert g.tp_set.size() == n and g.tp_set.rank() == hvd.rank() and g.dp_set.size() == 1 == g.pp_set.size()
    assert g.next_rank is None and g.prev_rank is None and g.is_first_stage and g.is_last_stage
    if n == 4:
        three_d = ProcessGrid(dp=1, tp=2, pp=2)
        at = three_d.coords
        assert (at.tp, at.pp) == (hvd.rank() % 2, hvd.rank() // 2), f"(1, 2, 2) coordinates {at}"
        assert three_d.next_rank == (hvd.rank() + 2 if at.pp == 0 else None), f"next rank {three_d.next_rank}"
        assert three_d.prev_rank == (hvd.rank() - 2 if at.pp == 1 else None), f"previous rank {three_d.prev_rank}"
        assert three_d.world_rank(dp=0, tp=1, pp=1) == 3
        three_d.free()


def check_bad_layouts(key: str) -> None:
    """Refused before any communication (every rank raises alike)."""
    n = hvd.size()
    expect_raises(InvalidArgumentError, lambda: ProcessGrid(dp=1, tp=n, pp=2), f"does not match the {n} ranks",
                  "product larger than the world")
    expect_raises(ArgumentTypeError, lambda: ProcessGrid(dp=1.0, tp=n), "dp must be an int", "float dp")
    expect_raises(InvalidArgumentError, lambda: ProcessGrid(dp=0, tp=n), "dp must be at least 1", "zero dp")
    ps = grid().tp_set
    expect_raises(InvalidArgumentError, lambda: tp.ParallelSelfAttention(DIM * 3, 3 * n // 2 if n == 2 else 6,
                                                                         process_set=ps),
                  "is not divisible by the tensor-parallel size", "heads not divisible")
    expect_raises(InvalidArgumentError, lambda: tp.ColumnParallelLinear(DIM, 6 + 1, process_set=ps),
                  "out_features (7) is not divisible by the tensor-parallel size", "column outputs")
    expect_raises(InvalidArgumentError, lambda: tp.RowParallelLinear(7, DIM, process_set=ps),
                  "in_features (7) is not divisible", "row inputs")
    expect_raises(InvalidArgumentError, lambda: tp.RowParallelLinear(DIM, DIM, process_set=ps, sequence_parallel=True),
                  "sequence_parallel needs input_is_parallel=True", "sequence parallel row without parallel input")
    expect_raises(ArgumentTypeError, lambda: tp.ColumnParallelLinear(DIM, DIM, process_set=[0, 1]),
                  "process_set must be a psrt ProcessSet", "list as process set")


def check_mismatched_inputs(key: str) -> None:
    """Rank 1 feeds a longer batch: every rank gets the same error naming both shapes, no hang."""
    ps = grid().tp_set
    layer = tp.RowParallelLinear(DIM, DIM, process_set=ps).double()
    rows = 3 if hvd.rank() == 1 else 2
    x = randn(key, (rows, DIM), "x")
    expect_raises(CollectiveMismatchError, lambda: layer(x), "rank 1 has all_reduce of a float64 tensor of shape "
                  f"({rows}, {DIM})" if hvd.rank() == 1 else "but rank 1 has all_reduce of a float64 tensor of "
                  f"shape (3, {DIM})", "longer batch on rank 1")
    # the set is still usable afterwards
    layer(randn(key, (2, DIM), "again"))
    expect_raises(InvalidArgumentError, lambda: tp.full_state_dict(layer, grid().dp_set),
                  "pass the tensor-parallel process set", "gathering over the wrong set")
    deep = randn(key, (1,) * 9 if hvd.rank() == 0 else (1, 1), "deep")  # 9 dimensions on rank 0 only
    expect_raises(CollectiveMismatchError, lambda: tp.comm.all_reduce_(deep, ps),
                  "rank 0 has all_reduce of a float64 tensor of shape (1, 1, 1, 1, 1, 1, 1, 1, ...)", "9 dimensions")
    n = hvd.size()
    if n == 4:  # a set of the right size but the wrong members: every rank raises, none gathers
        other = ProcessGrid(dp=2, tp=2)
        split_layer = tp.RowParallelLinear(DIM, DIM, process_set=other.tp_set)
        expect_raises(InvalidArgumentError, lambda: tp.full_state_dict(split_layer, other.dp_set),
                      "pass the tensor-parallel process set", "gathering over the DP set")
        other.free()
    sequence_parallel = tp.RowParallelLinear(DIM, DIM, process_set=ps, input_is_parallel=True,
                                             sequence_parallel=True).double()
    odd = randn(key, (BATCH, n + 1, DIM // n), "odd")
    expect_raises(InvalidArgumentError, lambda: sequence_parallel(odd),
                  f"dimension 1 of a tensor of shape ({BATCH}, {n + 1}, {DIM}) is not divisible", "odd sequence")


def check_tp_starts_while_the_engine_is_busy_on_the_world(key: str) -> None:
    """The first TP collective over the world set while the engine runs collectives on it."""
    handles = [hvd.allgather_async(torch.full((64,), float(hvd.rank())), name=f"{key}.{i}") for i in range(50)]
    total = tp.comm.all_reduce_(torch.ones(1000), hvd.global_process_set)
    assert torch.equal(total, torch.full((1000,), float(hvd.size()))), "TP all-reduce over the world"
    for handle in handles:
        hvd.synchronize(handle)


def check_engine_and_tp_share_a_set(key: str) -> None:
    """An asynchronous hvd collective on the TP set runs in the engine thread while TP layers
    run collectives on the same set from this thread: they use separate communicators."""
    ps = grid().tp_set
    layer = tp.RowParallelLinear(DIM, DIM, process_set=ps).double()
    reference = nn.Linear(DIM, DIM).double()
    tp.load_full_state_dict(reference, tp.full_state_dict(layer, ps))
    x = randn(key, (BATCH, DIM), "x")
    for i in range(20):
        handle = hvd.allreduce_async(torch.full((4096,), float(hvd.rank() + i)), name=f"{key}.{i}", op=hvd.Sum,
                                     process_set=ps)
        close(layer(x).detach(), reference(x).detach(), f"layer output, round {i}")
        total = hvd.synchronize(handle)
        want = sum(r + i for r in range(hvd.size()))
        assert torch.equal(total, torch.full((4096,), float(want))), f"engine allreduce, round {i}"


def check_block_without_shape_check(key: str) -> None:
    """PSRT_TP_CHECK_SHAPES=0 (which the topology reads when the runtime starts): the same
    results without any agreement."""
    ps = grid().tp_set
    topology, group = ps.topology, ps.topology.direct(ps)
    before = group.agreements
    topology.tp_check_shapes = False
    try:
        check_block(key, "block", False)
    finally:
        topology.tp_check_shapes = True
    assert group.agreements == before, f"{group.agreements - before} agreements without the check"


SEED = 1234
DROPOUT = 0.25


def all_equal_across_ranks(tensor: torch.Tensor) -> bool:
    everyone = tp.comm.all_gather(tensor.detach().double().reshape(1, -1), 0, grid().tp_set)
    return all(torch.equal(row, everyone[0]) for row in everyone)


def all_differ_across_ranks(tensor: torch.Tensor) -> bool:
    everyone = tp.comm.all_gather(tensor.detach().double().reshape(1, -1), 0, grid().tp_set)
    rows = [tuple(row.tolist()) for row in everyone]
    return len(set(rows)) == len(rows)


def stream_draw(seed: int, shape) -> torch.Tensor:
    """What ``dropout_mask`` draws from a default generator seeded with ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return tp_random.dropout_mask(shape, DROPOUT, torch.device("cpu"))


def check_tracker_streams(key: str) -> None:
    """Inside a fork each TP rank draws from ``seed + 2718 + rank``; outside, every rank
    draws the same; a fork leaves the default generator where it was; reseeding replays."""
    ps = grid().tp_set
    draws = []
    for _ in range(2):
        tp.manual_seed(SEED, ps)
        with tp.rng_tracker().fork():
            inside = torch.rand(64, dtype=torch.float64)
        outside = torch.rand(64, dtype=torch.float64)
        draws.append((inside, outside))
    assert all_differ_across_ranks(draws[0][0]), "draws inside the fork agree between TP ranks"
    assert all_equal_across_ranks(draws[0][1]), "draws outside the fork differ between TP ranks"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + tp_random.TENSOR_PARALLEL_SEED_OFFSET + hvd.rank())
        assert torch.equal(draws[0][0], torch.rand(64, dtype=torch.float64)), "the fork's stream is not seeded " \
            "with seed + 2718 + tp rank"
        torch.manual_seed(SEED)
        assert torch.equal(draws[0][1], torch.rand(64, dtype=torch.float64)), "the fork moved the default stream"
    assert all(torch.equal(a, b) for a, b in zip(draws[0], draws[1])), "reseeding did not replay the draws"


class MaskRecorder:
    """Records every dropout mask the TP layers draw, and whether it was drawn in a fork."""

    def __init__(self) -> None:
        self.masks: list[tuple[bool, torch.Tensor]] = []
        self._original = tp_random.dropout_mask
        self._forks = 0

    def __enter__(self) -> "MaskRecorder":
        original_fork = tp_random.RNGStatesTracker.fork
        recorder = self

        def draw(shape, p, device):
            mask = recorder._original(shape, p, device)
            recorder.masks.append((recorder._forks > 0, mask.clone()))
            return mask

        def fork(tracker, name=tp_random.TENSOR_PARALLEL_STREAM):
            recorder._forks += 1
            try:
                yield from original_fork.__wrapped__(tracker, name)
            finally:
                recorder._forks -= 1

        self._saved_fork = original_fork
        tp_random.dropout_mask = draw
        tp_random.RNGStatesTracker.fork = contextlib.contextmanager(fork)
        return self

    def __exit__(self, *exc) -> None:
        tp_random.dropout_mask = self._original
        tp_random.RNGStatesTracker.fork = self._saved_fork


def check_block_dropout_masks(key: str, sequence_parallel: bool) -> None:
    """The masks of a TP block: attention-probability masks (a TP region, drawn in the
    fork) differ per rank and are exactly the rank's stream; the residual-branch masks
    (replicated, or the whole sequence with sequence parallelism) agree on every rank."""
    n, ps = hvd.size(), grid().tp_set
    tp.manual_seed(SEED, ps)
    block = tp.ParallelTransformerBlock(DIM, HEADS, process_set=ps, sequence_parallel=sequence_parallel,
                                        dropout=DROPOUT, attention_dropout=DROPOUT).double()
    x = randn(key, (BATCH, SEQ // n if sequence_parallel else SEQ, DIM), "x")
    with MaskRecorder() as recorder:
        block(x)
    kinds = [forked for forked, _ in recorder.masks]
    assert kinds == [True, False, False], f"mask draws (in fork?) {kinds}, expected attention then 2 residuals"
    attention = recorder.masks[0][1]
    assert attention.shape == (BATCH, HEADS // n, SEQ, SEQ), f"attention mask shape {tuple(attention.shape)}"
    assert torch.equal(attention, stream_draw(SEED + tp_random.TENSOR_PARALLEL_SEED_OFFSET + hvd.rank(),
                                              attention.shape)), "attention mask is not this rank's stream"
    assert all_differ_across_ranks(attention), "attention masks agree between TP ranks"
    for _, residual in recorder.masks[1:]:
        assert residual.shape == (BATCH, SEQ, DIM), f"residual mask drawn for shape {tuple(residual.shape)}"
        assert all_equal_across_ranks(residual), "residual-branch masks differ between TP ranks"
    assert all_equal_across_ranks(torch.get_rng_state()), "the default generators drifted apart"


def check_block_dropout_matches_single_process(key: str, sequence_parallel: bool) -> None:
    """With dropout on the residual branches only, a TP block equals the same block in one
    process, masks included (outputs and every gradient, float64)."""
    n, ps = hvd.size(), grid().tp_set
    torch.manual_seed(11)
    reference = tp.ParallelTransformerBlock(DIM, HEADS, dropout=DROPOUT).double()
    block = tp.ParallelTransformerBlock(DIM, HEADS, process_set=ps, sequence_parallel=sequence_parallel,
                                        dropout=DROPOUT).double()
    tp.load_full_state_dict(block, reference.state_dict())
    x_full, x_mine = with_input(key, (BATCH, SEQ, DIM), sequence_parallel, n)
    tp.manual_seed(SEED)
    ref_out = reference(x_full)
    weights = randn(key, ref_out.shape, "R")
    (ref_out * weights).sum().backward()
    tp.manual_seed(SEED, ps)
    out = block(x_mine)
    (out * (block_of(weights, 1, n) if sequence_parallel else weights)).sum().backward()
    close(out.detach(), block_of(ref_out.detach(), 1, n) if sequence_parallel else ref_out.detach(), "output")
    close(x_mine.grad, block_of(x_full.grad, 1, n) if sequence_parallel else x_full.grad, "input gradient")
    grads = {name: p.grad for name, p in reference.named_parameters()}
    for name, param in block.named_parameters():
        sharding = tp.sharding.sharding_of(param)
        close(param.grad, grads[name] if sharding is None else sharding.shard(grads[name]), f"gradient of {name}")


BACKWARD_COUNTS = {  # a block's backward; a full recomputation runs the forward's collectives once more
    (None, False): {"all_reduce": 2},
    (None, True): {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 4},
    ("full", False): {"all_reduce": 4},
    ("full", True): {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 4},
}


def check_recompute(key: str, mode: str, sequence_parallel: bool) -> None:
    """A block with every dropout on and ``recompute=mode`` gives the same output, input
    gradient and parameter gradients as the same block keeping its activations (the masks
    replayed, tracker streams included), leaves every random stream where that block
    leaves it, keeps fewer activation bytes, and runs the expected collectives."""
    x, weights = _block_input(key, sequence_parallel)
    runs = {}
    for recompute in (None, mode):
        block, leaf = _seeded_block(x, sequence_parallel, recompute)
        saved = SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = block(leaf)
        tp.stats().reset()
        (out * weights).sum().backward()
        runs[recompute] = (out.detach(), leaf.grad, [p.grad for p in block.parameters()], saved.bytes,
                           dict(tp.stats().counts), torch.get_rng_state(), tp.rng_tracker().get_states())
    base, again = runs[None], runs[mode]
    close(again[0], base[0], f"{mode} recomputation: output")
    close(again[1], base[1], f"{mode} recomputation: input gradient")
    for i, (got, want) in enumerate(zip(again[2], base[2])):
        close(got, want, f"{mode} recomputation: gradient of parameter {i}")
    assert again[3] < base[3], f"{mode} recomputation kept {again[3]} B of activations, without it {base[3]} B"
    want_counts = BACKWARD_COUNTS[(mode if mode == "full" else None, sequence_parallel)]
    assert base[4] == BACKWARD_COUNTS[(None, sequence_parallel)], f"backward ran {base[4]}"
    assert again[4] == want_counts, f"{mode} recomputation: backward ran {again[4]}, expected {want_counts}"
    assert torch.equal(again[5], base[5]), "the default generator ends elsewhere than without recomputation"
    tensor_parallel = tp_random.TENSOR_PARALLEL_STREAM
    assert torch.equal(again[6][tensor_parallel]["cpu"], base[6][tensor_parallel]["cpu"]), \
        "the tensor-parallel stream ends elsewhere than without recomputation"


def check_split_backward_recomputes_once_per_half(key: str, sequence_parallel: bool) -> None:
    """A zero-bubble split backward (input half, then weight half) of a block with
    ``recompute="full"`` gives the ordinary backward's gradients and runs the forward's
    collectives once more per half: ``BACKWARD_COUNTS`` plus one recomputation, not one
    recomputation per group of parameters."""
    x, weights = _block_input(key, sequence_parallel)
    runs = {}
    for split in (False, True):
        block, leaf = _seeded_block(x, sequence_parallel, "full")
        out = block(leaf)
        tp.stats().reset()
        if split:
            backward_input(out, weights, leaf, list(block.parameters())).run()
        else:
            out.backward(weights)
        runs[split] = (leaf.grad, [p.grad for p in block.parameters()], dict(tp.stats().counts))
    close(runs[True][0], runs[False][0], "split backward: input gradient")
    for i, (got, want) in enumerate(zip(runs[True][1], runs[False][1])):
        close(got, want, f"split backward: gradient of parameter {i}")
    forward = {kind: count - BACKWARD_COUNTS[(None, sequence_parallel)].get(kind, 0)
               for kind, count in BACKWARD_COUNTS[("full", sequence_parallel)].items()}  # one recomputation's
    want = {kind: count + forward.get(kind, 0) for kind, count in runs[False][2].items()}
    assert runs[True][2] == want, f"split backward ran {runs[True][2]}, expected {want} (one recomputation more)"


def _block_input(key: str, sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's input (this rank's part of the sequence under sequence parallelism) and the
    weights its output is summed with."""
    x = randn(key, (BATCH, SEQ // hvd.size() if sequence_parallel else SEQ, DIM), "x")
    return x, randn(key, x.shape, "R")


def _seeded_block(x: torch.Tensor, sequence_parallel: bool, recompute: str | None):
    """The same block with every dropout on, its random streams seeded alike, and a fresh leaf of ``x``."""
    torch.manual_seed(11)
    ps = grid().tp_set
    block = tp.ParallelTransformerBlock(DIM, HEADS, process_set=ps, sequence_parallel=sequence_parallel,
                                        dropout=DROPOUT, attention_dropout=DROPOUT, recompute=recompute).double()
    tp.manual_seed(SEED, ps)
    return block, x.clone().requires_grad_()


class SavedBytes:
    """Bytes autograd saves for backward outside a recomputed region (distinct storages)."""

    def __init__(self) -> None:
        self.bytes, self._seen = 0, set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor


def check_dropout_and_recompute_arguments(key: str) -> None:
    """Refused before any communication, alike on every rank."""
    ps = grid().tp_set
    expect_raises(InvalidArgumentError, lambda: tp.ParallelTransformerBlock(DIM, HEADS, process_set=ps,
                                                                            recompute="partial"),
                  "recompute must be one of None, 'full', 'selective', got 'partial'", "unknown recompute mode")
    expect_raises(InvalidArgumentError, lambda: tp.ParallelSelfAttention(DIM, HEADS, process_set=ps, recompute="full"),
                  "recompute must be one of None, 'selective'", "full recomputation of the attention alone")
    expect_raises(InvalidArgumentError, lambda: tp.ParallelTransformerBlock(DIM, HEADS, process_set=ps, dropout=1.0),
                  "dropout must lie in [0, 1), got 1.0", "dropout of 1")
    expect_raises(ArgumentTypeError, lambda: tp.ParallelTransformerBlock(DIM, HEADS, process_set=ps,
                                                                         attention_dropout="0.1"),
                  "attention_dropout must be a float, got str", "dropout as a string")
    expect_raises(ArgumentTypeError, lambda: tp.manual_seed(1.5, ps), "seed must be an int, got float", "float seed")
    tp.rng_tracker().reset()
    block = tp.ParallelTransformerBlock(DIM, HEADS, process_set=ps, attention_dropout=DROPOUT).double()
    expect_raises(InvalidArgumentError, lambda: block(randn(key, (BATCH, SEQ, DIM), "x")),
                  "call psrt.tp.manual_seed(seed, tp_process_set)", "attention dropout without seeding the tracker")


_GRID: list[ProcessGrid] = []


def grid() -> ProcessGrid:
    if not _GRID:
        _GRID.append(ProcessGrid(dp=1, tp=hvd.size(), pp=1))
    return _GRID[0]


def main() -> None:
    hvd.init()
    grid()
    checks = _harness.Checks()
    checks.add("grid/coordinates_sets_and_neighbours", check_grid)
    for sp in (False, True):
        suffix = "/sequence_parallel" if sp else ""
        for gather in (False, True):
            if not (sp and gather):
                checks.add(f"column{suffix}/gather_output_{gather}", check_column, gather, sp)
        for parallel_input in ((True,) if sp else (False, True)):
            checks.add(f"row{suffix}/input_is_parallel_{parallel_input}", check_row, parallel_input, sp)
        checks.add(f"embedding{suffix}/padded_vocabulary", check_embedding, sp)
        for part in ("mlp", "attention", "block"):
            checks.add(f"{part}{suffix}/matches_torch_nn", check_block, part, sp)
    checks.add("block/without_shape_check/matches_torch_nn", check_block_without_shape_check)
    checks.add("rng/tracker_streams_per_rank_inside_shared_outside", check_tracker_streams)
    for sp in (False, True):
        suffix = "/sequence_parallel" if sp else ""
        checks.add(f"rng/block_dropout_masks{suffix}", check_block_dropout_masks, sp)
        checks.add(f"rng/residual_dropout_matches_single_process{suffix}", check_block_dropout_matches_single_process,
                   sp)
        for mode in ("full", "selective"):
            checks.add(f"recompute/{mode}{suffix}/matches_keeping_activations", check_recompute, mode, sp)
        checks.add(f"recompute/full{suffix}/split_backward_recomputes_once_per_half",
                   check_split_backward_recomputes_once_per_half, sp)
    checks.add("errors/dropout_and_recompute_arguments", check_dropout_and_recompute_arguments)
    checks.add("cross_entropy/padded_vocabulary_three_all_reduces", check_cross_entropy)
    checks.add("errors/bad_layouts", check_bad_layouts)
    checks.add("errors/mismatched_inputs_across_tp_ranks", check_mismatched_inputs)
    checks.add("concurrency/engine_and_tp_share_a_set", check_engine_and_tp_share_a_set)
    checks.add("concurrency/tp_starts_while_the_engine_is_busy", check_tp_starts_while_the_engine_is_busy_on_the_world)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
