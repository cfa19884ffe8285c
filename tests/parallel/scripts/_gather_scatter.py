"""Checks of allgather, broadcast, alltoall and reducescatter against numpy references."""
from __future__ import annotations

import torch

import psrt.torch as hvd

from _harness import Checks
from _reference import DTYPES, NUMERIC, assert_equal, check_reduced, sample, samples

_ROWS = (0, 2, 3, 1)  # allgather rows of rank r: r % 4; rank 0 contributes nothing


def _rank_size() -> tuple[int, int]:
    return hvd.rank(), hvd.size()


# -- allgather --------------------------------------------------------------------------
def allgather(key: str, dtype_name: str, tail: tuple[int, ...] = (3,)) -> None:
    """First dimensions differ by rank; the result is every rank's rows in rank order."""
    rank, size = _rank_size()
    inputs = [sample(key, r, DTYPES[dtype_name], (_ROWS[r % 4], *tail)) for r in range(size)]
    mine = inputs[rank].clone()
    got = hvd.allgather(mine, name=key)
    assert_equal(got, torch.cat(inputs), key)
    assert mine.equal(inputs[rank]), f"{key}: the input was modified"


def allgather_0d(key: str) -> None:
    """Each rank's 0-d tensor counts as one row."""
    rank, size = _rank_size()
    inputs = [sample(key, r, torch.float32, ()) for r in range(size)]
    assert_equal(hvd.allgather(inputs[rank], name=key), torch.stack(inputs), key)


def allgather_noncontiguous(key: str) -> None:
    rank, size = _rank_size()
    bases = [sample(key, r, torch.float32, (3, _ROWS[r % 4] + 2)) for r in range(size)]
    view = bases[rank].clone().t()
    assert_equal(hvd.allgather(view, name=key), torch.cat([b.t() for b in bases]), key)
    assert not view.is_contiguous(), f"{key}: bad test, the input should be non-contiguous"


def allgather_all_empty(key: str) -> None:
    empty = torch.empty((0, 2), dtype=torch.int32)
    assert_equal(hvd.allgather(empty, name=key), torch.empty((0, 2), dtype=torch.int32), key)


# -- broadcast --------------------------------------------------------------------------
def broadcast(key: str, dtype_name: str, root: int, in_place: bool,
              shape: tuple[int, ...] = (4, 5)) -> None:
    rank, size = _rank_size()
    inputs = samples(key, size, DTYPES[dtype_name], shape)
    mine = inputs[rank].clone()
    if in_place:
        got = hvd.broadcast_(mine, root_rank=root, name=key)
        assert got is mine, f"{key}: broadcast_ returned a new tensor instead of its argument"
    else:
        got = hvd.broadcast(mine, root_rank=root, name=key)
        assert got is not mine, f"{key}: broadcast returned its argument"
        assert mine.equal(inputs[rank]), f"{key}: the input was modified"
    assert_equal(got, inputs[root], key)


def broadcast_inplace_noncontiguous(key: str) -> None:
    rank, size = _rank_size()
    bases = samples(key, size, torch.float32, (3, 5))
    base = bases[rank].clone()
    view = base.t()
    assert hvd.broadcast_(view, root_rank=size - 1, name=key) is view
    assert_equal(view, bases[size - 1].t(), key + " (view)")
    assert_equal(base, bases[size - 1], key + " (base of the view)")


# -- alltoall ---------------------------------------------------------------------------
def uneven_splits(rank: int, size: int) -> list[int]:
    """Rows ``rank`` sends to each destination: uneven, some zero."""
    return [(rank + 2 * d) % 3 for d in range(size)]


def _alltoall_expected(inputs: list[torch.Tensor], splits: list[list[int]], me: int):
    pieces, received = [], []
    for source, tensor in enumerate(inputs):
        start = sum(splits[source][:me])
        pieces.append(tensor[start:start + splits[source][me]])
        received.append(splits[source][me])
    return torch.cat(pieces), received


def check_alltoall(got: object, inputs, splits, rank: int, key: str) -> None:
    """``got`` is (received rows, received splits), as alltoall returns when given splits."""
    assert isinstance(got, tuple) and len(got) == 2, f"{key}: returned {type(got).__name__}, " \
                                                      "expected (tensor, received_splits)"
    output, received = got
    want, want_received = _alltoall_expected(inputs, splits, rank)
    assert_equal(output, want, key)
    assert isinstance(received, torch.Tensor) and received.tolist() == want_received, (
        f"{key}: received splits {received!r}, expected {want_received}")


def alltoall(key: str, dtype_name: str, as_tensor: bool = False, transposed: bool = False) -> None:
    rank, size = _rank_size()
    splits = [uneven_splits(r, size) for r in range(size)]
    if transposed:
        inputs = [sample(key, r, DTYPES[dtype_name], (2, sum(splits[r]))).t() for r in range(size)]
    else:
        inputs = [sample(key, r, DTYPES[dtype_name], (sum(splits[r]), 2)) for r in range(size)]
    mine = inputs[rank].clone() if not transposed else inputs[rank].t().clone().t()
    arg = torch.tensor(splits[rank]) if as_tensor else splits[rank]
    check_alltoall(hvd.alltoall(mine, splits=arg, name=key), inputs, splits, rank, key)
    assert mine.equal(inputs[rank]), f"{key}: the input was modified"


def alltoall_even(key: str, dtype_name: str) -> None:
    """Without splits the first dimension is divided evenly, and only the rows are returned."""
    rank, size = _rank_size()
    inputs = samples(key, size, DTYPES[dtype_name], (2 * size, 3))
    got = hvd.alltoall(inputs[rank], name=key)
    assert isinstance(got, torch.Tensor), f"{key}: returned {type(got).__name__}, expected a tensor"
    assert_equal(got, _alltoall_expected(inputs, [[2] * size for _ in range(size)], rank)[0], key)


def alltoall_one_rank_sends_nothing(key: str) -> None:
    rank, size = _rank_size()
    splits = [[0] * size] + [[1] * size for _ in range(size - 1)]
    inputs = [sample(key, r, torch.float64, (sum(splits[r]), 2)) for r in range(size)]
    check_alltoall(hvd.alltoall(inputs[rank], splits=splits[rank], name=key), inputs, splits,
                    rank, key)


# -- reducescatter ------------------------------------------------------------------------
def kept_rows(rows: int, size: int) -> list[int]:
    """Horovod's rule: the first ``rows % size`` ranks keep one extra row."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def reducescatter(key: str, dtype_name: str, op: str, rows: int | None = None,
                  scaled: bool = False, transposed: bool = False, default_op: bool = False) -> None:
    rank, size = _rank_size()
    dtype = DTYPES[dtype_name]
    rows = 2 * size + 1 if rows is None else rows
    pre, post = ((0.5, 4.0) if dtype.is_floating_point else (2, 3)) if scaled else (1.0, 1.0)
    if transposed:
        inputs = [t.t() for t in samples(key, size, dtype, (3, rows), op=op)]
    else:
        inputs = samples(key, size, dtype, (rows, 3), op=op, factor=int(pre * post))
    kwargs = {} if default_op else {"op": getattr(hvd, op)}
    if scaled:
        kwargs.update(prescale_factor=pre, postscale_factor=post)
    got = hvd.reducescatter(inputs[rank], name=key, **kwargs)
    kept = kept_rows(rows, size)
    start = sum(kept[:rank])
    check_reduced(got, [t[start:start + kept[rank]] for t in inputs], op, key, pre=pre, post=post)


def add_checks(checks: Checks) -> None:
    size = hvd.size()
    for d in DTYPES:
        checks.add(f"allgather/{d}", allgather, d)
    checks.add("allgather_1d/float32", allgather, "float32", ())
    checks.add("allgather_0d/float32", allgather_0d)
    checks.add("allgather_noncontiguous/float32", allgather_noncontiguous)
    checks.add("allgather_all_empty/int32", allgather_all_empty)
    for in_place, form in ((False, "broadcast"), (True, "broadcast_inplace")):
        for d in DTYPES:
            for root in range(size):
                name = f"{form}/{d}/root{root}"
                checks.add(name, broadcast, d, root, in_place)
        checks.add(f"{form}_0d/int64", broadcast, "int64", size - 1,
                   in_place, ())
        checks.add(f"{form}_empty/float32", broadcast, "float32", 0,
                   in_place, (0, 3))
    checks.add("broadcast_inplace_noncontiguous/float32", broadcast_inplace_noncontiguous)
    for d in DTYPES:
        checks.add(f"alltoall/{d}", alltoall, d)
        checks.add(f"alltoall_even/{d}", alltoall_even, d)
    checks.add("alltoall_splits_tensor/int32", alltoall, "int32",
               True)
    checks.add("alltoall_noncontiguous/float32", alltoall, "float32", False, True)
    checks.add("alltoall_one_rank_sends_nothing/float64", alltoall_one_rank_sends_nothing)
    for d in NUMERIC:
        for op in ("Sum", "Average"):  # the only ops reducescatter takes, as in Horovod
            checks.add(f"reducescatter/{d}/{op}", reducescatter, d, op)
    for label, rows in (("zero", 0), ("fewer_than_ranks", 1), ("even", 2 * size),
                        ("remainder_size_minus_1", 3 * size - 1)):
        name = f"reducescatter_rows/{label}"
        checks.add(name, reducescatter, "float32", "Sum", rows)
    for d in ("float32", "float16", "int32"):
        name = f"reducescatter_scaled/{d}"
        checks.add(name, reducescatter, d, "Average", None, True)
    checks.add("reducescatter_noncontiguous/float32", reducescatter, "float32", "Sum", None,
               False, True)
    checks.add("reducescatter_default_op_is_average/float32", reducescatter, "float32",
               "Average", None, False,
               False, True)
