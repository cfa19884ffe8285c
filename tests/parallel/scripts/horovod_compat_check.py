"""Horovod scripts that must run after changing only the import line (issue 13, item 5), in one job.

Run on every rank (``psrun -np N python horovod_compat_check.py``); rank 0 prints one
JSON line per check (see ``_harness``).  Each check is a behaviour Horovod documents:
alltoall's return values and splits errors, the callable handle of
``sparse_allreduce_async``, ``join(device)`` and integer Average under it, broadcasts
rooted outside rank 0's process set, optimizer state broadcast before any step,
``DistributedOptimizer``'s parameter names and sparse gradients, and Adasum (allreduce
and optimizer) against a single-process reference of the same recursive combination, and
the ``HOROVOD_*`` variables horovodrun gives each worker.
"""
from __future__ import annotations

import os
import socket

import numpy as np
import torch

import psrt.torch as hvd
from psrt.errors import UnsupportedOperationError

import _harness
from _reference import assert_equal, expect_raises, rng_for, sample

_SETS: dict[str, hvd.ProcessSet] = {}


def _upper_ranks(size: int) -> list[int]:
    """A set without rank 0 whose first rank is not 0: [1] at 2 ranks, [2, 3] at 4."""
    return list(range(size // 2, size))


def _floats(key: str, rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.from_numpy(rng_for(key, rank).normal(0.0, 1.0, shape)).to(dtype)


# -- 1. alltoall ------------------------------------------------------------------------------
def _even_inputs(key: str, size: int) -> list[torch.Tensor]:
    return [sample(key, r, torch.float32, (2 * size, 3)) for r in range(size)]


def _even_expected(inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    return torch.cat([t[2 * rank:2 * rank + 2] for t in inputs])


def alltoall_without_splits_returns_the_tensor(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = _even_inputs(key, size)
    got = hvd.alltoall(inputs[rank], name=key)
    assert isinstance(got, torch.Tensor), f"{key}: returned {type(got).__name__}, expected a tensor"
    assert_equal(got, _even_expected(inputs, rank), key)


def alltoall_with_splits_returns_the_pair(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = _even_inputs(key, size)
    for form, splits in (("list", [2] * size), ("tensor", torch.full((size,), 2, dtype=torch.int32))):
        got = hvd.alltoall(inputs[rank], splits=splits, name=f"{key}.{form}")
        assert isinstance(got, tuple) and len(got) == 2, f"{key} ({form}): returned {type(got).__name__}"
        assert_equal(got[0], _even_expected(inputs, rank), f"{key} ({form})")
        assert got[1].tolist() == [2] * size, f"{key} ({form}): received splits {got[1].tolist()}"


def alltoall_async_returns_the_pair_either_way(key: str) -> None:
    """Horovod's synchronize gives (output, received splits) with or without splits."""
    rank, size = hvd.rank(), hvd.size()
    inputs = _even_inputs(key, size)
    for form, splits in (("none", None), ("list", [2] * size)):
        got = hvd.synchronize(hvd.alltoall_async(inputs[rank], splits=splits, name=f"{key}.{form}"))
        assert isinstance(got, tuple) and len(got) == 2, f"{key} ({form}): returned {type(got).__name__}"
        assert_equal(got[0], _even_expected(inputs, rank), f"{key} ({form})")
        assert got[1].tolist() == [2] * size, f"{key} ({form}): received splits {got[1].tolist()}"


def alltoall_autograd_without_splits(key: str) -> None:
    """The differentiable form returns the tensor alone too; row i of this rank's input went to
    rank i // 2, whose loss weighs it by (that rank + 1)."""
    rank, size = hvd.rank(), hvd.size()
    mine = _even_inputs(key, size)[rank].double().requires_grad_()
    out = hvd.alltoall(mine, name=key)
    assert isinstance(out, torch.Tensor), f"{key}: returned {type(out).__name__}"
    (out * (rank + 1)).sum().backward()
    want = torch.arange(2 * size, dtype=torch.float64).div(2, rounding_mode="floor").add(1)
    assert_equal(mine.grad, want[:, None].expand(2 * size, 3), key)


def alltoall_float_splits_raise_value_error(key: str) -> None:
    """As in Horovod, a ValueError (and still psrt's TypeError), before any communication."""
    size = hvd.size()
    tensor = torch.ones(2 * size, 3)
    for splits in ([2.0] * size, torch.full((size,), 2.0)):
        exc = expect_raises(ValueError, lambda: hvd.alltoall(tensor, splits=splits), "splits", what=key)
        assert isinstance(exc, TypeError), f"{key}: {type(exc).__name__} is not also a TypeError"
    hvd.barrier()


# -- 2. sparse_allreduce_async ------------------------------------------------------------------
def _sparse_input(key: str, rank: int) -> torch.Tensor:
    rows = torch.tensor([(rank + 2 * k) % 6 for k in range(rank + 2)] + [rank % 6])
    return torch.sparse_coo_tensor(rows[None], _floats(key, rank, (len(rows), 3)), (6, 3), check_invariants=True)


def sparse_allreduce_async_handle_is_called(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = [_sparse_input(key, r) for r in range(size)]
    total = sum(t.to_dense() for t in inputs)
    for op, want in (("Sum", total), ("Average", total / size)):
        handle = hvd.sparse_allreduce_async(inputs[rank], name=f"{key}.{op}", op=getattr(hvd, op))
        assert callable(handle), f"{key}: the handle is a {type(handle).__name__}, not callable"
        got = handle()
        assert got.is_sparse and not got.is_coalesced() and got._nnz() == sum(t._nnz() for t in inputs), (
            f"{key} {op}: expected every rank's entries side by side, as Horovod returns")
        torch.testing.assert_close(got.to_dense(), want, rtol=1e-12, atol=1e-12, msg=f"{key} {op}")


# -- 3. join -------------------------------------------------------------------------------------
_TOWARD_ZERO = [-75, 75, -7, 7, -1, 1, 0]


def join_takes_horovods_device_argument(key: str) -> None:
    """``join(device=-1)`` and, as Horovod's tests call it on CPU too, ``join(local_rank())``;
    a device that is not an int, or below -1, raises before joining."""
    size = hvd.size()
    expect_raises(TypeError, lambda: hvd.join(device="cpu"), "device", "'cpu'", what=key)
    expect_raises(ValueError, lambda: hvd.join(device=-2), "device", "-2", what=key)
    lasts = (hvd.join(device=-1), hvd.join(hvd.local_rank()))
    every = hvd.allgather_object(lasts, name=key)
    assert every == [lasts] * size and all(0 <= last < size for last in lasts), (
        f"{key}: join returned {every} on the ranks")


def integer_average_rounds_toward_zero(key: str) -> None:
    """Without join: rank 1 contributes the values, the others zeros; sums of -75 average to -37."""
    rank, size = hvd.rank(), hvd.size()
    for dtype in (torch.int8, torch.int32, torch.int64):
        mine = torch.tensor(_TOWARD_ZERO if rank == 1 else [0] * len(_TOWARD_ZERO), dtype=dtype)
        got = hvd.allreduce(mine, op=hvd.Average, name=f"{key}.{dtype}")
        want = torch.tensor([int(v / size) for v in _TOWARD_ZERO], dtype=dtype)
        assert_equal(got, want, f"{key} {dtype}")


def _average_under_join(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    for dtype in (torch.int32, torch.int64):
        mine = torch.tensor(_TOWARD_ZERO if rank == 1 else [0] * len(_TOWARD_ZERO), dtype=dtype)
        got = hvd.allreduce(mine, op=hvd.Average, name=f"{key}.{dtype}")
        assert_equal(got, torch.tensor([int(v / size) for v in _TOWARD_ZERO], dtype=dtype), f"{key} {dtype}")
    got = hvd.allreduce(torch.full((3,), 4.0), op=hvd.Average, name=f"{key}.float")
    assert_equal(got, torch.full((3,), 4.0 * (size - 1) / size), f"{key} float32")


def join_integer_average_rounds_toward_zero_then_allgather_object(key: str) -> None:
    """Rank 0 joins at once; the others average integers (rank 0 counts, with zeros), rounded
    toward zero as any integer Average, and a float one; then every rank gathers objects.
    A rank whose averages are wrong still joins, so that the check fails rather than hangs."""
    rank, size = hvd.rank(), hvd.size()
    failure = None
    if rank != 0:
        try:
            _average_under_join(key)
        except AssertionError as exc:
            failure = exc
    last = hvd.join()
    assert last != 0, f"{key}: join() returned rank 0, which joined first"
    assert hvd.allgather_object(last, name=key) == [last] * size, f"{key}: ranks disagree on the last rank"
    if failure is not None:
        raise failure


# -- 4. broadcasts rooted outside rank 0's set ----------------------------------------------------
def broadcast_object_root_is_a_global_rank(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    members = _upper_ranks(size)
    if rank not in members:
        return
    for root in (members[0], members[-1]):
        got = hvd.broadcast_object({"from": rank} if rank == root else None, root_rank=root,
                                   name=f"{key}.{root}", process_set=_SETS["upper"])
        assert got == {"from": root}, f"{key}: root {root} gave {got!r}"


def broadcast_optimizer_state_root_is_a_global_rank(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    members = _upper_ranks(size)
    if rank not in members:
        return
    root = members[0]
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1 * (rank + 1), momentum=0.9)
    param.grad = torch.full((3,), float(rank))
    optimizer.step()
    hvd.broadcast_optimizer_state(optimizer, root_rank=root, process_set=_SETS["upper"])
    assert optimizer.param_groups[0]["lr"] == 0.1 * (root + 1), f"{key}: lr {optimizer.param_groups[0]['lr']}"
    assert_equal(optimizer.state[param]["momentum_buffer"], torch.full((3,), float(root)), key)


# -- 5. broadcast_optimizer_state before any state exists -------------------------------------------
class _IndexedScale(torch.nn.Module):
    """Horovod's model of test_broadcast_state_no_grad: an integer, frozen index and a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = torch.nn.Parameter(torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.a.long()) * x


def broadcast_optimizer_state_of_a_fresh_optimizer(key: str) -> None:
    """No rank has state: it is created as Horovod does (zero gradients, one step), so a
    trainable parameter has a gradient to broadcast afterwards; a frozen one has none."""
    torch.manual_seed(hvd.rank())
    model = _IndexedScale()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True),
        named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    frozen, weight = optimizer.param_groups[0]["params"]
    assert frozen.grad is None, f"{key}: the frozen parameter got a gradient"
    assert isinstance(weight.grad, torch.Tensor) and not weight.grad.any(), f"{key}: gradient {weight.grad!r}"
    assert_equal(hvd.broadcast(weight.grad, root_rank=0, name=key), weight.grad, key)
    assert "momentum_buffer" in optimizer.state[weight], f"{key}: no state after the broadcast"
    assert_equal(weight.detach(), hvd.broadcast(weight.detach(), root_rank=0, name=f"{key}.weight"),
                 f"{key}: the initializing step moved the ranks apart")


def broadcast_optimizer_state_with_unused_parameter_and_none_entries(key: str) -> None:
    """The root's Adam has no state for a parameter it never used, and a None entry: every
    rank ends with the root's layout and values (the others' state for it is dropped)."""
    rank, size = hvd.rank(), hvd.size()
    root = size - 1
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([used, unused], lr=0.1)
    used.grad = torch.full((3,), float(rank + 1))
    if rank != root:  # the root's step leaves ``unused`` without a gradient, hence without state
        unused.grad = torch.ones(2)
    optimizer.step()
    optimizer.state[used]["lookahead"] = None if rank == root else torch.ones(3)
    hvd.broadcast_optimizer_state(optimizer, root_rank=root)
    assert not optimizer.state.get(unused), f"{key}: state kept for the parameter the root never used"
    assert optimizer.state[used]["lookahead"] is None, f"{key}: the root's None entry did not arrive"
    torch.testing.assert_close(optimizer.state[used]["exp_avg"], torch.full((3,), 0.1 * (root + 1)), msg=key)


# -- 6. parameter names ----------------------------------------------------------------------------
def parameter_names_as_horovod(key: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    names = optimizer._parameter_names
    want = {p: f"allreduce.noname.{i}.{j}" for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])}
    assert names == want, f"{key}: names {sorted(names.values())}"
    every = hvd.allgather_object(sorted(names.values()), name=key)
    assert all(n == every[0] for n in every), f"{key}: ranks name parameters differently"
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}, f"{key}: given names"


# -- 7. sparse gradients ---------------------------------------------------------------------------
def _embedding_batch(rank: int) -> torch.Tensor:
    return torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if rank % 2 == 0 else torch.tensor([[1, 3, 4], [4, 7, 9]])


def sparse_gradients_stay_sparse(key: str) -> None:
    """Horovod's test_sparse_embeddings, checked: SparseAdam steps on the gradient averaged
    over every rank, which stays sparse whether or not it was reduced densely."""
    rank, size = hvd.rank(), hvd.size()
    for sparse_as_dense in (False, True):
        what = f"{key} sparse_as_dense={sparse_as_dense}"
        torch.manual_seed(7)
        model = torch.nn.Embedding(10, 3, sparse=True).double()
        want_model = torch.nn.Embedding(10, 3, sparse=True).double()
        want_model.load_state_dict(model.state_dict())
        optimizer = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(model.parameters()), lr=0.1),
                                             named_parameters=model.named_parameters(),
                                             sparse_as_dense=sparse_as_dense)
        optimizer.zero_grad()
        (model(_embedding_batch(rank)) * (rank + 1)).sum().backward()
        optimizer.synchronize()
        grad = model.weight.grad
        assert grad.is_sparse, f"{what}: the reduced gradient is dense"
        want = sum(torch.zeros(10, 3, dtype=torch.float64).index_add_(
            0, _embedding_batch(r).reshape(-1),
            torch.full((_embedding_batch(r).numel(), 3), r + 1.0, dtype=torch.float64))
            for r in range(size)) / size
        torch.testing.assert_close(grad.to_dense(), want, msg=what)
        with optimizer.skip_synchronize():
            optimizer.step()
        want_model.weight.grad = want.to_sparse(1)
        torch.optim.SparseAdam(list(want_model.parameters()), lr=0.1).step()
        torch.testing.assert_close(model.weight, want_model.weight, msg=what)


# -- 8. Adasum -----------------------------------------------------------------------------------
def adasum_reference(vectors: list[np.ndarray]) -> np.ndarray:
    """Horovod's Adasum over ranks, in float64: pairs (0, 1), (2, 3)..., then pairs of pairs."""
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    level = [np.asarray(v, dtype=np.float64).ravel() for v in vectors]
    while len(level) > 1:
        combined = []
        for a, b in zip(level[0::2], level[1::2]):
            dot, a2, b2 = a @ b, a @ a, b @ b
            a_weight = 1.0 - dot / (2.0 * a2) if a2 >= tiny else 1.0
            b_weight = 1.0 - dot / (2.0 * b2) if b2 >= tiny else 1.0
            combined.append(a_weight * a + b_weight * b)
        level = combined
    return level[0].reshape(np.shape(vectors[0]))


def _assert_adasum(got: torch.Tensor, inputs: list[torch.Tensor], what: str, rtol: float = 1e-12) -> None:
    want = adasum_reference([t.double().numpy() for t in inputs])
    assert got.dtype == inputs[0].dtype and tuple(got.shape) == tuple(inputs[0].shape), f"{what}: {got.dtype}"
    error = np.abs(got.double().numpy() - want).max(initial=0.0)
    assert error <= rtol * max(np.abs(want).max(initial=0.0), 1.0), f"{what}: off by {error:.3g}"


def adasum_allreduce_matches_reference(key: str) -> None:
    """Every form (allreduce, allreduce_, async, grouped with its own coefficients per tensor,
    scale factors, float32) equals the recursive combination of the gathered inputs."""
    rank, size = hvd.rank(), hvd.size()
    inputs = [_floats(key, r, (5, 3)) for r in range(size)]
    _assert_adasum(hvd.allreduce(inputs[rank], op=hvd.Adasum, name=key), inputs, f"{key} allreduce")
    mine = inputs[rank].clone()
    assert hvd.allreduce_(mine, op=hvd.Adasum, name=f"{key}.inplace") is mine
    _assert_adasum(mine, inputs, f"{key} allreduce_")
    handle = hvd.allreduce_async(inputs[rank], op=hvd.Adasum, name=f"{key}.async")
    _assert_adasum(hvd.synchronize(handle), inputs, f"{key} allreduce_async")
    others = [_floats(f"{key}.second", r, (7,)) * (r + 1) for r in range(size)]
    first, second = hvd.grouped_allreduce([inputs[rank], others[rank]], op=hvd.Adasum, name=f"{key}.grouped")
    _assert_adasum(first, inputs, f"{key} grouped[0]")
    _assert_adasum(second, others, f"{key} grouped[1]")
    scaled = hvd.allreduce(inputs[rank], op=hvd.Adasum, prescale_factor=2.0, postscale_factor=0.25,
                           name=f"{key}.scaled")
    _assert_adasum(scaled, [t * 0.5 for t in inputs], f"{key} scaled")
    singles = [t.float() for t in inputs]
    _assert_adasum(hvd.allreduce(singles[rank], op=hvd.Adasum, name=f"{key}.float32"), singles,
                   f"{key} float32", rtol=1e-6)


def adasum_of_orthogonal_is_the_sum_and_of_equal_is_the_vector(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    basis = torch.eye(size, dtype=torch.float64)
    assert_equal(hvd.allreduce(basis[rank] * (rank + 1), op=hvd.Adasum, name=f"{key}.orthogonal"),
                 torch.arange(1.0, size + 1, dtype=torch.float64), f"{key} orthogonal")
    same = _floats(key, 0, (4,))
    torch.testing.assert_close(hvd.allreduce(same, op=hvd.Adasum, name=f"{key}.equal"), same,
                               rtol=1e-15, atol=0.0, msg=f"{key} equal")


def adasum_is_bit_identical_on_every_rank(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    got = hvd.allreduce(_floats(key, rank, (1000,), torch.float32), op=hvd.Adasum, name=key)
    every = hvd.allgather(got[None], name=f"{key}.gathered")
    assert all(torch.equal(row, got) for row in every), f"{key}: ranks hold different results"


def adasum_on_a_process_set(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    members = _upper_ranks(size)
    if rank not in members:
        return
    inputs = [_floats(key, r, (6,)) for r in members]
    got = hvd.allreduce(inputs[members.index(rank)], op=hvd.Adasum, name=key, process_set=_SETS["upper"])
    _assert_adasum(got, inputs, key)


def adasum_unsupported_raises_value_and_runtime_error(key: str) -> None:
    """Before any communication: reducescatter, integers, and (at 4 ranks) a set of 3 ranks."""
    rank = hvd.rank()
    tensor = torch.ones(4, 2)
    cases = [("reducescatter", lambda: hvd.reducescatter(tensor, op=hvd.Adasum), ("Adasum",)),
             ("int64", lambda: hvd.allreduce(tensor.long(), op=hvd.Adasum), ("floating-point", "int64"))]
    if "three" in _SETS and rank in (0, 1, 2):
        cases += [("set of 3", lambda: hvd.allreduce(tensor, op=hvd.Adasum, process_set=_SETS["three"]),
                   ("power of two", "3 ranks")),
                  ("optimizer on a set of 3", lambda: hvd.DistributedOptimizer(
                      torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), op=hvd.Adasum,
                      process_set=_SETS["three"]), ("power of two", "3 ranks"))]
    for what, call, fragments in cases:
        exc = expect_raises(UnsupportedOperationError, call, *fragments, what=f"{key} {what}")
        assert isinstance(exc, ValueError) and isinstance(exc, RuntimeError), f"{key} {what}: {type(exc).__mro__}"
    hvd.barrier()


def _adasum_batch(key: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = rng_for(f"{key}/{step}", rank)
    return torch.from_numpy(rng.normal(size=(6, 4))), torch.from_numpy(rng.normal(size=(6, 2)))


def _adasum_model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2)).double()


def adasum_optimizer_matches_reference(key: str) -> None:
    """DistributedOptimizer(op=Adasum) over two steps equals, in one process: every rank's own
    SGD-with-momentum step from the shared parameters, then the shared parameters plus the
    Adasum of the ranks' parameter changes, tensor by tensor."""
    rank, size = hvd.rank(), hvd.size()
    model = _adasum_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters(), op=hvd.Adasum)
    replicas = [_adasum_model() for _ in range(size)]
    local = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replicas]
    shared = [p.detach().clone() for p in replicas[0].parameters()]
    for step in range(2):
        x, y = _adasum_batch(key, rank, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        deltas = []
        for r, (replica, opt) in enumerate(zip(replicas, local)):
            with torch.no_grad():
                for p, s in zip(replica.parameters(), shared):
                    p.copy_(s)
            x, y = _adasum_batch(key, r, step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(replica(x), y).backward()
            opt.step()
            deltas.append([(p.detach() - s).numpy() for p, s in zip(replica.parameters(), shared)])
        shared = [s + torch.from_numpy(adasum_reference([d[i] for d in deltas])) for i, s in enumerate(shared)]
        for i, (got, want) in enumerate(zip(model.parameters(), shared)):
            torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12,
                                       msg=f"{key}: step {step}, parameter {i}")


# -- 7. the launcher's variables --------------------------------------------------------------
def horovod_variables_name_each_ranks_place(key: str) -> None:
    """HOROVOD_RANK and the rest, as horovodrun sets them, equal hvd's own answers, and
    the ranks' (rank, local rank) pairs are all different."""
    expected = {"RANK": hvd.rank(), "SIZE": hvd.size(), "LOCAL_RANK": hvd.local_rank(),
                "LOCAL_SIZE": hvd.local_size(), "CROSS_RANK": hvd.cross_rank(), "CROSS_SIZE": hvd.cross_size()}
    got = {name: os.environ.get(f"HOROVOD_{name}") for name in expected}
    assert got == {name: str(value) for name, value in expected.items()}, f"{key}: {got} != {expected}"
    assert os.environ.get("HOROVOD_HOSTNAME") == socket.gethostname(), f"{key}: {os.environ.get('HOROVOD_HOSTNAME')}"
    places = hvd.allgather_object((got["RANK"], got["LOCAL_RANK"]), name=key)
    assert len(set(places)) == hvd.size(), f"{key}: ranks share a place: {places}"


def main() -> None:
    hvd.init()
    size = hvd.size()
    # The first optimizer imports torch._dynamo (about 10 s here): pay it before any check's clock starts.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    _SETS["upper"] = hvd.add_process_set(_upper_ranks(size))
    if size == 4:
        _SETS["three"] = hvd.add_process_set([0, 1, 2])
    checks = _harness.Checks()
    checks.add("alltoall/without_splits_returns_the_tensor", alltoall_without_splits_returns_the_tensor)
    checks.add("alltoall/with_splits_returns_the_pair", alltoall_with_splits_returns_the_pair)
    checks.add("alltoall/async_returns_the_pair_either_way", alltoall_async_returns_the_pair_either_way)
    checks.add("alltoall/autograd_without_splits", alltoall_autograd_without_splits)
    checks.add("alltoall/float_splits_raise_value_error", alltoall_float_splits_raise_value_error)
    checks.add("sparse_allreduce_async/handle_is_called", sparse_allreduce_async_handle_is_called)
    checks.add("join/takes_horovods_device_argument", join_takes_horovods_device_argument)
    checks.add("allreduce/integer_average_rounds_toward_zero", integer_average_rounds_toward_zero)
    checks.add("join/integer_average_rounds_toward_zero_then_allgather_object",
               join_integer_average_rounds_toward_zero_then_allgather_object)
    checks.add("broadcast_object/root_is_a_global_rank", broadcast_object_root_is_a_global_rank)
    checks.add("broadcast_optimizer_state/root_is_a_global_rank", broadcast_optimizer_state_root_is_a_global_rank)
    checks.add("broadcast_optimizer_state/fresh_optimizer", broadcast_optimizer_state_of_a_fresh_optimizer)
    checks.add("broadcast_optimizer_state/unused_parameter_and_none_entries",
               broadcast_optimizer_state_with_unused_parameter_and_none_entries)
    checks.add("optimizer/parameter_names_as_horovod", parameter_names_as_horovod)
    checks.add("optimizer/sparse_gradients_stay_sparse", sparse_gradients_stay_sparse)
    checks.add("adasum/allreduce_matches_reference", adasum_allreduce_matches_reference)
    checks.add("adasum/orthogonal_is_the_sum_and_equal_is_the_vector",
               adasum_of_orthogonal_is_the_sum_and_of_equal_is_the_vector)
    checks.add("adasum/bit_identical_on_every_rank", adasum_is_bit_identical_on_every_rank)
    checks.add("adasum/process_set", adasum_on_a_process_set)
    checks.add("adasum/unsupported_raises_value_and_runtime_error", adasum_unsupported_raises_value_and_runtime_error)
    checks.add("adasum/optimizer_matches_reference", adasum_optimizer_matches_reference)
    checks.add("launcher/horovod_variables_name_each_ranks_place", horovod_variables_name_each_ranks_place)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
