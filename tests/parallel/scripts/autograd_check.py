"""Differentiable collectives (psrt.torch.collectives) against a single-process reference.

Run on every rank (``psrun -np N python autograd_check.py``).  Each check
builds every rank's inputs and upstream gradients from (check name, rank),
runs the collective on its own input in float32, and backpropagates
``sum(output * upstream)``.  The reference computes every rank's output from
all inputs in float64 with plain torch, backpropagates the weighted sum of
the ranks' losses, and this rank compares its output and its input's gradient
with its slice of the reference.

The weight is where Horovod's conventions show: 1 (the sum of the ranks'
losses) for allreduce and alltoall, 1/size (their mean) for allgather and
broadcast, size for reducescatter.
"""
from __future__ import annotations

import functools
import zlib
from typing import Callable, Sequence

import torch

import psrt.torch as hvd
from psrt.errors import InvalidArgumentError
from psrt.torch.collectives.reducescatter import reducescatter_rows

import _harness
from _reference import expect_raises

Tensors = list[torch.Tensor]
_ROWS = (0, 2, 3, 1)  # allgather rows of rank r: _ROWS[r % 4]; rank 0 contributes nothing
_SUBSET: dict[str, hvd.ProcessSet] = {}


def _sample(key: str, rank: int, shape: Sequence[int]) -> torch.Tensor:
    """Float32-representable float64 values, a pure function of (key, rank, shape)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{key}|{rank}".encode()))
    return torch.randn(tuple(shape), generator=generator, dtype=torch.float64).float().double()


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float) -> None:
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    error = (got.double() - want).abs()
    tolerance = rtol * (1.0 + want.abs())
    if bool((error > tolerance).any()):
        worst = int((error - tolerance).reshape(-1).argmax())
        raise AssertionError(f"{what}: {int((error > tolerance).sum())} of {error.numel()} "
                             f"elements differ; worst at flat index {worst}: got "
                             f"{got.reshape(-1)[worst].item():.6g}, expected "
                             f"{want.reshape(-1)[worst].item():.6g}")


def check_gradients(key: str, shapes: Callable[[int], Sequence[Sequence[int]]],
                    run: Callable[[Tensors], Tensors],
                    reference: Callable[[list[Tensors]], list[Tensors]],
                    weight: float = 1.0, rtol: float = 1e-5, track: bool = True,
                    process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
    """Compare ``run`` (this rank's tensors -> its outputs) with ``reference`` (every rank's
    tensors -> every rank's outputs); ``shapes(r)`` gives rank r's input shapes.  Ranks count
    within ``process_set``."""
    rank, size = process_set.rank(), process_set.size()
    inputs = [[_sample(f"{key}/in{i}", r, s) for i, s in enumerate(shapes(r))] for r in range(size)]
    mine = [t.float().requires_grad_(track) for t in inputs[rank]]
    outputs = run(mine)
    if track:
        upstream = [_sample(f"{key}/up{j}", rank, o.shape).float() for j, o in enumerate(outputs)]
        sum((o * u).sum() for o, u in zip(outputs, upstream)).backward()
    else:
        assert not any(o.requires_grad for o in outputs), f"{key}: untracked output requires grad"
    leaves = [[t.clone().requires_grad_() for t in ts] for ts in inputs]
    expected = reference(leaves)
    loss = sum((o * _sample(f"{key}/up{j}", r, o.shape)).sum()
               for r, outs in enumerate(expected) for j, o in enumerate(outs))
    (loss * weight).backward()
    assert len(outputs) == len(expected[rank]), f"{key}: {len(outputs)} outputs"
    for j, (got, want) in enumerate(zip(outputs, expected[rank])):
        _assert_close(got.detach(), want.detach(), f"{key}: output {j}", rtol)
    if not track:
        return
    for i, (got, leaf) in enumerate(zip(mine, leaves[rank])):
        assert got.grad is not None, f"{key}: input {i} got no gradient"
        want = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad  # unused: zero
        _assert_close(got.grad, want, f"{key}: gradient of input {i}", rtol)


def _reduce(tensors: Tensors, op: str, pre: float, post: float) -> torch.Tensor:
    total = sum(t * pre for t in tensors) * post
    return total / len(tensors) if op == "Average" else total


def _each(size: int, *tensors: torch.Tensor) -> list[Tensors]:
    """Every rank receives the same outputs."""
    return [list(tensors) for _ in range(size)]


# -- allreduce -------------------------------------------------------------------------------
def allreduce(key: str, op: str, pre: float = 1.0, post: float = 1.0, named: bool = True,
              track: bool = True) -> None:
    name = key if named else None
    check_gradients(
        key, lambda r: [(3, 4)],
        lambda ts: [hvd.allreduce(ts[0], name=name, op=getattr(hvd, op), prescale_factor=pre,
                                 postscale_factor=post)],
        lambda every: _each(len(every), _reduce([ts[0] for ts in every], op, pre, post)),
        track=track)


def allreduce_compression_fp16(key: str) -> None:
    """The reduction travels in float16 both ways; the output keeps the input's dtype."""
    check_gradients(
        key, lambda r: [(5,)],
        lambda ts: [hvd.allreduce(ts[0], name=key, op=hvd.Sum, compression=hvd.Compression.fp16)],
        lambda every: _each(len(every), _reduce([ts[0] for ts in every], "Sum", 1.0, 1.0)),
        rtol=4e-3)


def allreduce_min_has_no_gradient(key: str) -> None:
    """Forward works; backward raises on every rank before any communication."""
    x = _sample(key, hvd.rank(), (3,)).float().requires_grad_()
    y = hvd.allreduce(x, name=key, op=hvd.Min)
    expect_raises(InvalidArgumentError, lambda: y.sum().backward(), "allreduce", "op=Min",
                  what=key)


def grouped_allreduce(key: str, op: str, pre: float = 1.0, post: float = 1.0) -> None:
    check_gradients(
        key, lambda r: [(2, 3), (4,), ()],
        lambda ts: hvd.grouped_allreduce(ts, name=key, op=getattr(hvd, op), prescale_factor=pre,
                                        postscale_factor=post),
        lambda every: _each(len(every), *[_reduce(list(column), op, pre, post)
                                          for column in zip(*every)]))


# -- allgather, broadcast ----------------------------------------------------------------------
def allgather(key: str, tail: tuple[int, ...] = (3,), named: bool = True,
              track: bool = True) -> None:
    """First dimensions differ by rank (rank 0 has none)."""
    name = key if named else None
    size = hvd.size()
    shape = (lambda r: [()]) if tail is None else (lambda r: [(_ROWS[r % 4], *tail)])
    join = torch.stack if tail is None else torch.cat
    check_gradients(key, shape, lambda ts: [hvd.allgather(ts[0], name=name)],
                    lambda every: _each(size, join([ts[0] for ts in every])),
                    weight=1.0 / size, track=track)


def grouped_allgather(key: str, named: bool = True) -> None:
    name = key if named else None
    size = hvd.size()
    check_gradients(key, lambda r: [(_ROWS[r % 4], 2), (r + 1,)],
                    lambda ts: hvd.grouped_allgather(ts, name=name),
                    lambda every: _each(size, *[torch.cat(column) for column in zip(*every)]),
                    weight=1.0 / size)


def broadcast(key: str, root: int, track: bool = True) -> None:
    size = hvd.size()
    check_gradients(key, lambda r: [(3, 2)],
                    lambda ts: [hvd.broadcast(ts[0], root_rank=root, name=key)],
                    lambda every: _each(size, every[root][0]), weight=1.0 / size, track=track)


# -- alltoall ----------------------------------------------------------------------------------
def _splits(rank: int, size: int) -> list[int]:
    return [(rank + 2 * d) % 3 for d in range(size)]  # includes zeros; rows differ by rank


def alltoall(key: str, splits_as: str, track: bool = True) -> None:
    """Rank r sends _splits(r)[d] rows to rank d (``even``: one row each, no splits given)."""
    size = hvd.size()
    split = (lambda r: [1] * size) if splits_as == "none" else (lambda r: _splits(r, size))

    def run(ts: Tensors) -> Tensors:
        splits = split(hvd.rank())
        if splits_as == "tensor":
            splits = torch.tensor(splits, dtype=torch.int32)
        if splits_as == "none":  # Horovod's return without splits: the rows alone
            out = hvd.alltoall(ts[0], name=key)
            assert isinstance(out, torch.Tensor), f"{key}: returned {type(out).__name__}"
            return [out]
        out, received = hvd.alltoall(ts[0], splits=splits, name=key)
        assert received.tolist() == [split(r)[hvd.rank()] for r in range(size)], (
            f"{key}: received splits {received.tolist()}")
        return [out]

    def reference(every: list[Tensors]) -> list[Tensors]:
        pieces = [every[r][0].split(split(r)) for r in range(size)]
        return [[torch.cat([pieces[r][d] for r in range(size)])] for d in range(size)]

    check_gradients(key, lambda r: [(sum(split(r)), 2)], run, reference, track=track)


# -- reducescatter -----------------------------------------------------------------------------
def _scattered(tensors: Tensors, op: str, pre: float, post: float) -> Tensors:
    total = _reduce(tensors, op, pre, post)
    return list(total.split(reducescatter_rows(total.shape[0], len(tensors))))


def reducescatter(key: str, op: str, rows: int, pre: float = 1.0, post: float = 1.0,
                  compression: object = None, rtol: float = 1e-5, track: bool = True) -> None:
    size = hvd.size()

    def reference(every: list[Tensors]) -> list[Tensors]:
        return [[block] for block in _scattered([ts[0] for ts in every], op, pre, post)]

    check_gradients(
        key, lambda r: [(rows, 3)],
        lambda ts: [hvd.reducescatter(ts[0], name=key, compression=compression,
                                     op=getattr(hvd, op), prescale_factor=pre,
                                     postscale_factor=post)],
        reference, weight=size, rtol=rtol, track=track)


def grouped_reducescatter(key: str, op: str, pre: float = 1.0, post: float = 1.0) -> None:
    size = hvd.size()

    def reference(every: list[Tensors]) -> list[Tensors]:
        columns = [_scattered(list(column), op, pre, post) for column in zip(*every)]
        return [[blocks[r] for blocks in columns] for r in range(size)]

    check_gradients(
        key, lambda r: [(2 * size + 1, 2), (1,)],
        lambda ts: hvd.grouped_reducescatter(ts, name=key, op=getattr(hvd, op),
                                            prescale_factor=pre, postscale_factor=post),
        reference, weight=size)


# -- process sets -------------------------------------------------------------------------------
def _subset_members(size: int) -> list[int]:
    return list(range(1, size))  # set ranks differ from world ranks


def subset_check(key: str, collective: str) -> None:
    """Allgather offsets count within the set; the broadcast root is a world rank."""
    subset = _SUBSET["set"]
    if not subset.included():
        return
    count = subset.size()

    def run(ts: Tensors) -> Tensors:
        if collective == "allgather":
            return [hvd.allgather(ts[0], name=key, process_set=subset)]
        root = _subset_members(hvd.size())[-1]  # a world rank, as in Horovod
        return [hvd.broadcast(ts[0], root_rank=root, name=key, process_set=subset)]

    def reference(every: list[Tensors]) -> list[Tensors]:
        out = torch.cat([ts[0] for ts in every]) if collective == "allgather" else every[-1][0]
        return _each(count, out)

    def shapes(r: int) -> list[tuple[int, ...]]:
        return [(_ROWS[r % 4], 2) if collective == "allgather" else (2, 2)]

    check_gradients(key, shapes, run, reference, weight=1.0 / count, process_set=subset)


# -- grouped asynchronous forms and sparse allreduce --------------------------------------------
def grouped_async(key: str, collective: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    if collective == "allgather":
        inputs = [[_sample(f"{key}/{i}", r, (_ROWS[r % 4] + i, 2)) for i in range(2)]
                  for r in range(size)]
        handle = hvd.grouped_allgather_async([t.float() for t in inputs[rank]], name=key)
        want = [torch.cat(column) for column in zip(*inputs)]
    else:
        inputs = [[_sample(f"{key}/{i}", r, (2 * size + i, 2)) for i in range(2)]
                  for r in range(size)]
        handle = hvd.grouped_reducescatter_async([t.float() for t in inputs[rank]], name=key,
                                                op=hvd.Sum)
        want = [_scattered(list(column), "Sum", 1.0, 1.0)[rank] for column in zip(*inputs)]
    while not hvd.poll(handle):
        pass
    got = hvd.synchronize(handle)
    assert isinstance(got, list) and len(got) == 2, f"{key}: synchronize gave {type(got).__name__}"
    for i, (g, w) in enumerate(zip(got, want)):
        _assert_close(g, w, f"{key}: tensor {i}", 1e-5)
    expect_raises(InvalidArgumentError, lambda: hvd.synchronize(handle), "already synchronized",
                  what=key)


def sparse_allreduce(key: str, op: str, dense_tail: tuple[int, ...], dtype: torch.dtype) -> None:
    """Entries differ in number and place by rank and repeat; the result is the dense reduction."""
    rank, size = hvd.rank(), hvd.size()
    shape = (6, 4) if not dense_tail else (6, *dense_tail)
    sparse_dims = 2 if not dense_tail else 1

    def sparse(r: int) -> torch.Tensor:
        count = r + 2
        rows = torch.tensor([(r + 3 * k) % 6 for k in range(count)] + [r % 6])
        where = rows[None] if sparse_dims == 1 else torch.stack([rows, rows % 4])
        values = _sample(key, r, (count + 1, *shape[sparse_dims:])).to(dtype)
        return torch.sparse_coo_tensor(where, values, shape, check_invariants=True)

    inputs = [sparse(r) for r in range(size)]
    handle = hvd.sparse_allreduce_async(inputs[rank], name=key, op=getattr(hvd, op))
    got = handle()  # Horovod's handle: called for the result
    assert got.is_sparse and got._nnz() == sum(t._nnz() for t in inputs), (
        f"{key}: result is not every rank's entries side by side (Horovod's, not coalesced)")
    assert got.dtype == dtype and tuple(got.shape) == shape, f"{key}: {got.dtype} {tuple(got.shape)}"
    want = sum(t.to_dense().double() for t in inputs)
    _assert_close(got.to_dense(), want / size if op == "Average" else want, key, 1e-5)


def main() -> None:
    hvd.init()
    size = hvd.size()
    _SUBSET["set"] = hvd.add_process_set(_subset_members(size))
    unnamed, untracked = {"named": False}, {"track": False}
    checks = _harness.Checks()

    def add(name: str, function: Callable[..., None], *args: object, **options: object) -> None:
        checks.add(name, functools.partial(function, **options), *args)

    for op in ("Sum", "Average"):
        add(f"allreduce/{op}", allreduce, op)
        add(f"allreduce_scaled/{op}", allreduce, op, 0.5, 3.0)
        add(f"grouped_allreduce_scaled/{op}", grouped_allreduce, op, 0.5, 3.0)
        add(f"reducescatter_scaled/{op}", reducescatter, op, 2 * size + 1, 0.5, 3.0)
        add(f"reducescatter_fewer_rows_than_ranks/{op}", reducescatter, op, 1)
        add(f"grouped_reducescatter_scaled/{op}", grouped_reducescatter, op, 0.5, 3.0)
        add(f"sparse_allreduce_async/{op}/rows", sparse_allreduce, op, (3,), torch.float32)
        add(f"sparse_allreduce_async/{op}/coordinates", sparse_allreduce, op, (), torch.float64)
    add("allreduce_unnamed", allreduce, "Sum", **unnamed)
    add("allreduce_compression_fp16", allreduce_compression_fp16)
    add("allreduce_min_has_no_gradient", allreduce_min_has_no_gradient)
    add("allgather_uneven_rows", allgather)
    add("allgather_0d", allgather, None)
    add("allgather_unnamed", allgather, **unnamed)
    add("grouped_allgather_uneven_rows", grouped_allgather)
    add("grouped_allgather_unnamed", grouped_allgather, **unnamed)
    for root in range(size):
        add(f"broadcast/root{root}", broadcast, root)
    for splits_as in ("list", "tensor", "none"):
        add(f"alltoall/splits_{splits_as}", alltoall, splits_as)
    add("reducescatter_compression_fp16", reducescatter, "Sum", 2 * size + 1,
        compression=hvd.Compression.fp16, rtol=4e-3)
    add("process_set/allgather", subset_check, "allgather")
    add("process_set/broadcast", subset_check, "broadcast")
    add("grouped_async/allgather", grouped_async, "allgather")
    add("grouped_async/reducescatter", grouped_async, "reducescatter")
    add("untracked/allreduce", allreduce, "Average", **untracked)
    add("untracked/allgather", allgather, **untracked)
    add("untracked/broadcast", broadcast, size - 1, **untracked)
    add("untracked/alltoall", alltoall, "list", **untracked)
    add("untracked/reducescatter", reducescatter, "Average", size + 1, **untracked)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
