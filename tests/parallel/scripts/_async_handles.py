"""Checks of every ``*_async`` form: poll() turns True, synchronize() returns the output once."""
from __future__ import annotations

import time

import torch

import psrt
import psrt.torch as hvd

from _gather_scatter import check_alltoall, kept_rows, uneven_splits
from _harness import Checks
from _reference import DTYPES, assert_equal, check_reduced, expect_raises, sample, samples

POLL_LIMIT_S = 10.0


def _finish(handle: object, key: str) -> object:
    """Poll until done, synchronize, and check that the handle is then released."""
    assert isinstance(handle, int) and not isinstance(handle, bool), (
        f"{key}: handle is {type(handle).__name__}, expected int")
    deadline = time.monotonic() + POLL_LIMIT_S
    while True:
        done = hvd.poll(handle)
        assert isinstance(done, bool), f"{key}: poll returned {type(done).__name__}"
        if done:
            break
        assert time.monotonic() < deadline, f"{key}: poll() still False after {POLL_LIMIT_S} s"
        time.sleep(0.0005)
    output = hvd.synchronize(handle)
    expect_raises(psrt.InvalidArgumentError, lambda: hvd.synchronize(handle), str(handle),
                  what=f"{key}: second synchronize")
    expect_raises(psrt.InvalidArgumentError, lambda: hvd.poll(handle), str(handle),
                  what=f"{key}: poll after synchronize")
    return output


def allreduce_async(key: str, dtype_name: str, op: str, in_place: bool,
                    transposed: bool = False, scaled: bool = False) -> None:
    rank, size = hvd.rank(), hvd.size()
    dtype = DTYPES[dtype_name]
    pre, post = ((0.5, 4.0) if dtype.is_floating_point else (2, 3)) if scaled else (1.0, 1.0)
    if transposed:
        inputs = [t.t() for t in samples(key, size, dtype, (5, 4), op=op)]
        mine = inputs[rank].t().clone().t()
    else:
        inputs = samples(key, size, dtype, (4, 5), op=op, factor=int(pre * post))
        mine = inputs[rank].clone()
    start = hvd.allreduce_async_ if in_place else hvd.allreduce_async
    output = _finish(start(mine, op=getattr(hvd, op), prescale_factor=pre,
                           postscale_factor=post, name=key), key)
    if in_place:
        assert output is mine, f"{key}: synchronize returned a new tensor, not the argument"
    else:
        assert mine.equal(inputs[rank]), f"{key}: the input was modified"
    check_reduced(output, inputs, op, key, pre=pre, post=post)


_MIXED = [("float32", (3, 2)), ("int64", (4,)), ("float16", (5,)), ("float64", ())]


def grouped_allreduce_async(key: str, op: str, in_place: bool) -> None:
    rank, size = hvd.rank(), hvd.size()
    group = [samples(f"{key}/{i}", size, DTYPES[d], shape, op=op)
             for i, (d, shape) in enumerate(_MIXED)]
    mine = [inputs[rank].clone() for inputs in group]
    start = hvd.grouped_allreduce_async_ if in_place else hvd.grouped_allreduce_async
    outputs = _finish(start(mine, op=getattr(hvd, op), name=key), key)
    assert isinstance(outputs, list) and len(outputs) == len(group), f"{key}: returned {outputs!r}"
    for i, (output, inputs) in enumerate(zip(outputs, group)):
        if in_place:
            assert output is mine[i], f"{key}: output {i} is not the argument tensor"
        check_reduced(output, inputs, op, f"{key} tensor {i}")


def allgather_async(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = [sample(key, r, torch.int16, (r + 1, 2)) for r in range(size)]
    assert_equal(_finish(hvd.allgather_async(inputs[rank], name=key), key), torch.cat(inputs), key)


def broadcast_async(key: str, in_place: bool) -> None:
    rank, size = hvd.rank(), hvd.size()
    root = size - 1 if in_place else 1
    inputs = samples(key, size, torch.bfloat16, (3, 3))
    mine = inputs[rank].clone()
    start = hvd.broadcast_async_ if in_place else hvd.broadcast_async
    output = _finish(start(mine, root_rank=root, name=key), key)
    assert (output is mine) == in_place, f"{key}: in-place form must return its argument, " \
                                         "the other a new tensor"
    assert_equal(output, inputs[root], key)


def alltoall_async(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    splits = [uneven_splits(r, size) for r in range(size)]
    inputs = [sample(key, r, torch.float32, (sum(splits[r]), 2)) for r in range(size)]
    got = _finish(hvd.alltoall_async(inputs[rank], splits=splits[rank], name=key), key)
    check_alltoall(got, inputs, splits, rank, key)


def reducescatter_async(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    rows = 2 * size + 1
    inputs = samples(key, size, torch.float32, (rows, 2))
    kept = kept_rows(rows, size)
    start = sum(kept[:rank])
    got = _finish(hvd.reducescatter_async(inputs[rank], op=hvd.Average, name=key), key)
    check_reduced(got, [t[start:start + kept[rank]] for t in inputs], "Average", key)


def many_outstanding(key: str) -> None:
    """Five operations in flight at once, synchronized in reverse order of starting."""
    rank, size = hvd.rank(), hvd.size()
    sums = samples(key + "/sum", size, torch.float64, (6,))
    gathered = [sample(key + "/gather", r, torch.int32, (r % 2 + 1,)) for r in range(size)]
    broadcast = samples(key + "/bcast", size, torch.float32, (4,))
    maxed = samples(key + "/max", size, torch.int8, (7,), op="Max")
    mine_bcast = broadcast[rank].clone()
    handles = [hvd.allreduce_async(sums[rank], op=hvd.Sum, name=key + "/sum"),
               hvd.allgather_async(gathered[rank], name=key + "/gather"),
               hvd.broadcast_async_(mine_bcast, root_rank=0, name=key + "/bcast"),
               hvd.allreduce_async(maxed[rank], op=hvd.Max, name=key + "/max")]
    assert len(set(handles)) == len(handles), f"{key}: handles repeat: {handles}"
    results = [_finish(h, key) for h in reversed(handles)][::-1]
    check_reduced(results[0], sums, "Sum", key + " allreduce")
    assert_equal(results[1], torch.cat(gathered), key + " allgather")
    assert results[2] is mine_bcast
    assert_equal(results[2], broadcast[0], key + " broadcast_")
    check_reduced(results[3], maxed, "Max", key + " allreduce Max")


def add_checks(checks: Checks) -> None:
    cases = [("allreduce_async", ("float32", "Sum", False)),
             ("allreduce_async_", ("int32", "Sum", True)),
             ("allreduce_async_/noncontiguous", ("float64", "Sum", True, True)),
             ("allreduce_async/float16_average", ("float16", "Average", False)),
             ("allreduce_async/scaled_average", ("float32", "Average", False, False, True)),
             ("allreduce_async/int_average", ("int64", "Average", False)),
             ("allreduce_async/bool_min", ("bool", "Min", False))]
    for name, args in cases:
        checks.add(f"async/{name}", allreduce_async, *args)
    checks.add("async/grouped_allreduce_async", grouped_allreduce_async, "Sum", False)
    checks.add("async/grouped_allreduce_async_", grouped_allreduce_async, "Max", True)
    checks.add("async/allgather_async", allgather_async)
    checks.add("async/broadcast_async", broadcast_async, False)
    checks.add("async/broadcast_async_", broadcast_async, True)
    checks.add("async/alltoall_async", alltoall_async)
    checks.add("async/reducescatter_async", reducescatter_async)
    checks.add("async/many_outstanding", many_outstanding)
