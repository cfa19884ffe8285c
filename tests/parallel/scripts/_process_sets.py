"""Checks of collectives on process sets that leave some ranks out.

Two sets are registered on every rank: "partial" ([0, 2] of 4 ranks, [1] of 2)
and "three" ([1, 2, 3] of 4, all of 2: three ranks make Average divide by a
number that is not a power of two).  Inputs are keyed by the rank within the set.
"""
from __future__ import annotations

import torch

import psrt
import psrt.torch as hvd

from _gather_scatter import check_alltoall, kept_rows, uneven_splits
from _harness import Checks
from _reference import assert_equal, check_reduced, expect_raises, sample

_SETS: dict[str, psrt.ProcessSet] = {}


def _members(size: int) -> dict[str, list[int]]:
    return {"partial": [0, 2] if size >= 4 else [size - 1],
            "three": [1, 2, 3] if size >= 4 else list(range(size))}


def register(key: str) -> None:
    members = _members(hvd.size())
    for label in ("partial", "three"):
        process_set = hvd.add_process_set(members[label])
        assert isinstance(process_set, hvd.ProcessSet), (
            f"{key}: add_process_set returned {process_set!r}")
        _SETS[label] = process_set
    ids = {s.process_set_id for s in _SETS.values()} | {hvd.global_process_set.process_set_id}
    assert len(ids) == 3 and None not in ids, f"{key}: process set ids {ids} are not distinct"


def membership(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    for label, ranks in _members(size).items():
        process_set = _SETS[label]
        seen = (process_set.included(), process_set.rank(), process_set.size())
        want = (rank in ranks, ranks.index(rank) if rank in ranks else -1, len(ranks))
        assert seen == want, (
            f"{key} {label} {ranks}: (included, rank, size) = {seen}, expected {want}")
    seen = (hvd.global_process_set.included(), hvd.global_process_set.rank(),
            hvd.global_process_set.size())
    assert seen == (True, rank, size), f"{key} global: {seen}, expected {(True, rank, size)}"


def _each_set_i_am_in():
    """(label, process set, my rank in it, its size) for every set containing the caller."""
    rank = hvd.rank()
    for label, ranks in _members(hvd.size()).items():
        if rank in ranks:
            yield label, _SETS[label], ranks.index(rank), len(ranks)


def allreduce(key: str) -> None:
    for label, process_set, me, count in _each_set_i_am_in():
        for dtype in (torch.float32, torch.int32, torch.float16):
            for op in ("Sum", "Average", "Min"):
                what = f"{key} {label} {dtype} {op}"
                inputs = [sample(what, r, dtype, (3, 4), op=op, contributors=count)
                          for r in range(count)]
                got = hvd.allreduce(inputs[me], op=getattr(hvd, op), name=what,
                                    process_set=process_set)
                check_reduced(got, inputs, op, what)
                mine = inputs[me].clone()
                assert hvd.allreduce_(mine, op=getattr(hvd, op), name=what + "_",
                                      process_set=process_set) is mine
                check_reduced(mine, inputs, op, what + " (in place)")


def grouped_allreduce(key: str) -> None:
    for label, process_set, me, count in _each_set_i_am_in():
        group = [[sample(f"{key}/{label}/{i}", r, d, (i + 2,), contributors=count)
                  for r in range(count)] for i, d in enumerate((torch.float64, torch.int16))]
        got = hvd.grouped_allreduce([g[me] for g in group], op=hvd.Average, name=key,
                                    process_set=process_set)
        for i, inputs in enumerate(group):
            check_reduced(got[i], inputs, "Average", f"{key} {label} tensor {i}")


def allgather(key: str) -> None:
    for label, process_set, me, count in _each_set_i_am_in():
        inputs = [sample(f"{key}/{label}", r, torch.int64, (2 - r % 2, 3)) for r in range(count)]
        got = hvd.allgather(inputs[me], name=key, process_set=process_set)
        assert_equal(got, torch.cat(inputs), f"{key} {label}")


def broadcast(key: str) -> None:
    """``root_rank`` is a global rank, as in Horovod: world rank 2 is the second of [0, 2]."""
    members = _members(hvd.size())
    for label, process_set, me, count in _each_set_i_am_in():
        for index, root in enumerate(members[label]):
            what = f"{key} {label} root {root}"
            inputs = [sample(what, r, torch.float32, (2, 3)) for r in range(count)]
            assert_equal(hvd.broadcast(inputs[me], root_rank=root, name=what,
                                       process_set=process_set), inputs[index], what)
            mine = inputs[me].clone()
            hvd.broadcast_(mine, root_rank=root, name=what + "_", process_set=process_set)
            assert_equal(mine, inputs[index], what + " (in place)")


def alltoall(key: str) -> None:
    for label, process_set, me, count in _each_set_i_am_in():
        splits = [uneven_splits(r, count) for r in range(count)]
        inputs = [sample(f"{key}/{label}", r, torch.float64, (sum(splits[r]), 2))
                  for r in range(count)]
        got = hvd.alltoall(inputs[me], splits=splits[me], name=key, process_set=process_set)
        check_alltoall(got, inputs, splits, me, f"{key} {label}")


def reducescatter(key: str) -> None:
    for label, process_set, me, count in _each_set_i_am_in():
        rows = 2 * count + 1
        inputs = [sample(f"{key}/{label}", r, torch.float32, (rows, 2)) for r in range(count)]
        kept = kept_rows(rows, count)
        start = sum(kept[:me])
        got = hvd.reducescatter(inputs[me], op=hvd.Sum, name=key, process_set=process_set)
        check_reduced(got, [t[start:start + kept[me]] for t in inputs], "Sum", f"{key} {label}")


def barrier_and_async(key: str) -> None:
    for label, process_set, me, count in _each_set_i_am_in():
        hvd.barrier(process_set=process_set)
        inputs = [sample(f"{key}/{label}", r, torch.float64, (5,)) for r in range(count)]
        handle = hvd.allreduce_async(inputs[me], op=hvd.Sum, name=key, process_set=process_set)
        check_reduced(hvd.synchronize(handle), inputs, "Sum", f"{key} {label}")


def explicit_global_set(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = [sample(key, r, torch.int64, (4,)) for r in range(size)]
    got = hvd.allreduce(inputs[rank], op=hvd.Sum, name=key, process_set=hvd.global_process_set)
    check_reduced(got, inputs, "Sum", key)


def non_members_raise(key: str) -> None:
    """Every collective called by a rank outside the set raises ProcessSetError at once."""
    rank = hvd.rank()
    process_set = _SETS["partial"]
    if process_set.included():
        return
    t = torch.ones(2 * hvd.size(), 2)
    calls = {
        "allreduce": lambda: hvd.allreduce(t, process_set=process_set),
        "allreduce_": lambda: hvd.allreduce_(t, process_set=process_set),
        "allreduce_async": lambda: hvd.allreduce_async(t, process_set=process_set),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([t], process_set=process_set),
        "allgather": lambda: hvd.allgather(t, process_set=process_set),
        "broadcast": lambda: hvd.broadcast(t, root_rank=0, process_set=process_set),
        "broadcast_": lambda: hvd.broadcast_(t, root_rank=0, process_set=process_set),
        "alltoall": lambda: hvd.alltoall(t, process_set=process_set),
        "reducescatter": lambda: hvd.reducescatter(t, process_set=process_set),
        "barrier": lambda: hvd.barrier(process_set=process_set),
    }
    for name, call in calls.items():
        expect_raises(psrt.ProcessSetError, call, f"rank {rank}", what=f"{key} {name}")


def add_checks(checks: Checks) -> None:
    for name, function in (("register", register), ("membership", membership),
                           ("allreduce", allreduce), ("grouped_allreduce", grouped_allreduce),
                           ("allgather", allgather), ("broadcast", broadcast),
                           ("alltoall", alltoall), ("reducescatter", reducescatter),
                           ("barrier_and_async", barrier_and_async),
                           ("explicit_global_set", explicit_global_set),
                           ("non_members_raise", non_members_raise)):
        checks.add(f"process_set/{name}", function)
