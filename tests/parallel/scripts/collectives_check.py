"""Every collective, op and dtype against a numpy reference, in one job.

Run on every rank (``psrun -np N python collectives_check.py [--ring]``).
Each rank builds every rank's input from (check name, rank), computes the
expected output itself and checks its own result; rank 0 prints one JSON line
per check (see ``_harness``).  ``--ring`` runs the allreduce checks meant for
a job started with a tiny ``PSRT_RING_THRESHOLD``/``PSRT_RING_SEGMENT``, so
that psrt's own ring (and its segmentation) carries small, odd sizes.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import psrt.runtime
import psrt.torch as hvd

import _async_handles
import _crowded
import _gather_scatter
import _harness
import _process_sets
from _reference import DTYPES, NUMERIC, OPS, check_reduced, ops_for, sample, samples

MiB = 1 << 20


def _rank_size() -> tuple[int, int]:
    return hvd.rank(), hvd.size()


# -- allreduce -----------------------------------------------------------------------
def allreduce(key: str, dtype_name: str, op: str, shape=(6, 7)) -> None:
    rank, size = _rank_size()
    inputs = samples(key, size, DTYPES[dtype_name], shape, op=op)
    mine = inputs[rank].clone()
    got = hvd.allreduce(mine, op=getattr(hvd, op), name=key)
    check_reduced(got, inputs, op, key)
    assert got is not mine and got.data_ptr() != mine.data_ptr(), f"{key}: result aliases the input"
    assert mine.equal(inputs[rank]), f"{key}: the input was modified"


def allreduce_scaled(key: str, dtype_name: str, op: str) -> None:
    """prescale multiplies every input, postscale the result (integers: whole factors)."""
    rank, size = _rank_size()
    dtype = DTYPES[dtype_name]
    pre, post = (0.5, 4.0) if dtype.is_floating_point else (2, 3)
    inputs = samples(key, size, dtype, (5, 3), op=op, factor=int(pre * post))
    mine = inputs[rank].clone()
    got = hvd.allreduce(mine, op=getattr(hvd, op), prescale_factor=pre, postscale_factor=post,
                        name=key)
    check_reduced(got, inputs, op, key, pre=pre, post=post)
    assert mine.equal(inputs[rank]), f"{key}: prescaling modified the input"


def allreduce_inplace(key: str, dtype_name: str) -> None:
    rank, size = _rank_size()
    op = "Max" if dtype_name == "bool" else "Sum"
    inputs = samples(key, size, DTYPES[dtype_name], (6, 7), op=op)
    mine = inputs[rank].clone()
    address = mine.data_ptr()
    got = hvd.allreduce_(mine, op=getattr(hvd, op), name=key)
    assert got is mine, f"{key}: allreduce_ returned a new tensor instead of its argument"
    assert mine.data_ptr() == address, f"{key}: the tensor's storage was replaced"
    check_reduced(mine, inputs, op, key)


def allreduce_inplace_noncontiguous(key: str, dtype_name: str) -> None:
    """allreduce_ on a transposed view writes the result back into the view (and its base)."""
    rank, size = _rank_size()
    op = "Max" if dtype_name == "bool" else "Sum"
    bases = samples(key, size, DTYPES[dtype_name], (7, 6), op=op)
    base = bases[rank].clone()
    view = base.t()
    got = hvd.allreduce_(view, op=getattr(hvd, op), name=key)
    assert not view.is_contiguous(), f"{key}: bad test, the input should be non-contiguous"
    assert got is view, f"{key}: allreduce_ returned a new tensor instead of its argument"
    check_reduced(view, [b.t() for b in bases], op, key + " (view)")
    check_reduced(base, bases, op, key + " (base of the view)")


def allreduce_noncontiguous(key: str) -> None:
    rank, size = _rank_size()
    bases = samples(key, size, DTYPES["float32"], (7, 6))
    view = bases[rank].clone().t()
    got = hvd.allreduce(view, op=hvd.Sum, name=key)
    check_reduced(got, [b.t() for b in bases], "Sum", key)
    assert view.equal(bases[rank].t()), f"{key}: the input was modified"


def allreduce_inplace_slice(key: str) -> None:
    """A contiguous slice with a storage offset: only the slice changes."""
    rank, size = _rank_size()
    whole = samples(key, size, DTYPES["float64"], (10,))
    mine = whole[rank].clone()
    hvd.allreduce_(mine[3:7], op=hvd.Sum, name=key)
    check_reduced(mine[3:7], [w[3:7] for w in whole], "Sum", key)
    assert mine[:3].equal(whole[rank][:3]) and mine[7:].equal(whole[rank][7:]), (
        f"{key}: elements outside the slice changed")


def allreduce_0d(key: str, dtype_name: str) -> None:
    rank, size = _rank_size()
    op = "Max" if dtype_name == "bool" else "Sum"
    inputs = samples(key, size, DTYPES[dtype_name], (), op=op)
    check_reduced(hvd.allreduce(inputs[rank].clone(), op=getattr(hvd, op), name=key),
                  inputs, op, key)
    mine = inputs[rank].clone()
    assert hvd.allreduce_(mine, op=getattr(hvd, op), name=key + "_") is mine
    check_reduced(mine, inputs, op, key + " (in place)")


def allreduce_empty(key: str, dtype_name: str, shape: tuple[int, ...]) -> None:
    for op in ("Sum", "Average", "Max"):
        empty = sample(key, 0, DTYPES[dtype_name], shape)
        got = hvd.allreduce(empty, op=getattr(hvd, op), name=f"{key}/{op}")
        check_reduced(got, [empty] * hvd.size(), op, f"{key} {op}")
        assert hvd.allreduce_(empty, op=getattr(hvd, op), name=f"{key}/{op}_") is empty


def allreduce_default_op_is_average(key: str) -> None:
    rank, size = _rank_size()
    inputs = samples(key, size, DTYPES["float32"], (4, 5))
    check_reduced(hvd.allreduce(inputs[rank], name=key), inputs, "Average", key + " (no op)")
    check_reduced(hvd.allreduce(inputs[rank], average=True, name=key), inputs, "Average",
                  key + " (average=True)")
    check_reduced(hvd.allreduce(inputs[rank], average=False, name=key), inputs, "Sum",
                  key + " (average=False)")


def allreduce_compression_fp16(key: str) -> None:
    """Compression.fp16 sends float16 but returns the input dtype."""
    rank, size = _rank_size()
    inputs = samples(key, size, DTYPES["float32"], (5, 4))
    got = hvd.allreduce(inputs[rank], op=hvd.Sum, compression=hvd.Compression.fp16, name=key)
    assert got.dtype == DTYPES["float32"], f"{key}: returned {got.dtype}, expected torch.float32"
    check_reduced(got.half(), [t.half() for t in inputs], "Sum", key)


# -- grouped allreduce ------------------------------------------------------------------
_GROUP = [("float32", (4, 3)), ("int32", (5,)), ("float16", (2, 2)), ("float64", ()),
          ("bfloat16", (3,)), ("int8", (4,)), ("float32", (0,)), ("int64", (2, 2)),
          ("uint8", (3,)), ("int16", (2,))]


def _group(key: str, op: str, rank: int, size: int) -> list[list[torch.Tensor]]:
    """Per member of the group: every rank's input."""
    members = _GROUP + ([("bool", (9,))] if op in ("Min", "Max", "Product") else [])
    return [samples(f"{key}/{i}", size, DTYPES[d], shape, op=op, factor=8)
            for i, (d, shape) in enumerate(members)]


def grouped_allreduce(key: str, op: str) -> None:
    rank, size = _rank_size()
    group = _group(key, op, rank, size)
    mine = [inputs[rank].clone() for inputs in group]
    got = hvd.grouped_allreduce(mine, op=getattr(hvd, op), name=key)
    assert isinstance(got, list) and len(got) == len(group), f"{key}: returned {type(got).__name__}"
    for i, (result, inputs) in enumerate(zip(got, group)):
        check_reduced(result, inputs, op, f"{key} tensor {i} ({inputs[0].dtype})")
        assert mine[i].equal(inputs[rank]), f"{key}: input {i} was modified"


def grouped_allreduce_scaled(key: str, op: str) -> None:
    rank, size = _rank_size()
    group = _group(key, op, rank, size)
    got = hvd.grouped_allreduce([inputs[rank] for inputs in group], op=getattr(hvd, op),
                                prescale_factor=2.0, postscale_factor=4.0, name=key)
    for i, (result, inputs) in enumerate(zip(got, group)):
        check_reduced(result, inputs, op, f"{key} tensor {i} ({inputs[0].dtype})",
                      pre=2.0, post=4.0)


def grouped_allreduce_inplace(key: str, op: str) -> None:
    """grouped_allreduce_ returns its own tensors, a transposed view among them."""
    rank, size = _rank_size()
    group = _group(key, op, rank, size)
    bases = samples(key + "/view", size, DTYPES["float32"], (3, 5), op=op)
    group.append([b.t() for b in bases])
    mine = [inputs[rank].clone() for inputs in group[:-1]] + [bases[rank].clone().t()]
    got = hvd.grouped_allreduce_(mine, op=getattr(hvd, op), name=key)
    assert len(got) == len(mine) and all(g is m for g, m in zip(got, mine)), (
        f"{key}: grouped_allreduce_ did not return its own tensors")
    for i, (result, inputs) in enumerate(zip(mine, group)):
        check_reduced(result, inputs, op, f"{key} tensor {i} ({inputs[0].dtype})")


# -- large allreduce: psrt's ring (>= PSRT_RING_THRESHOLD, 256 KiB by default) ------------
def large_allreduce(key: str, dtype_name: str, op: str, count: int,
                    form: str = "allreduce") -> None:
    rank, size = _rank_size()
    inputs = samples(key, size, DTYPES[dtype_name], (count,), op=op)
    mine = inputs[rank].clone()
    if form == "allreduce_":
        assert hvd.allreduce_(mine, op=getattr(hvd, op), name=key) is mine
        got = mine
    elif form == "allreduce_async":
        got = hvd.synchronize(hvd.allreduce_async(mine, op=getattr(hvd, op), name=key))
    else:
        got = hvd.allreduce(mine, op=getattr(hvd, op), name=key)
    check_reduced(got, inputs, op, key)


def _count(nbytes: int, dtype_name: str) -> int:
    """Elements of ``nbytes`` bytes, plus one: not divisible by 2 or 4 ranks."""
    return nbytes // DTYPES[dtype_name].itemsize + 1


def add_allreduce_checks(checks: _harness.Checks) -> None:
    for d in DTYPES:
        for op in ops_for(d):
            checks.add(f"allreduce/{d}/{op}", allreduce, d, op)
    for d in NUMERIC:
        for op in ("Sum", "Average"):
            checks.add(f"allreduce_scaled/{d}/{op}", allreduce_scaled, d, op)
    for d in DTYPES:
        checks.add(f"allreduce_inplace/{d}", allreduce_inplace, d)
    for d in ("float32", "bfloat16", "int64", "bool"):
        checks.add(f"allreduce_inplace_noncontiguous/{d}", allreduce_inplace_noncontiguous, d)
    for d in ("float32", "float16", "int64", "bool"):
        checks.add(f"allreduce_0d/{d}", allreduce_0d, d)
    for d, shape in (("float32", (0,)), ("int32", (3, 0)), ("float16", (0, 4))):
        checks.add(f"allreduce_empty/{d}", allreduce_empty, d, shape)
    for name, function in (("allreduce_noncontiguous", allreduce_noncontiguous),
                           ("allreduce_inplace_slice", allreduce_inplace_slice),
                           ("allreduce_default_op_is_average", allreduce_default_op_is_average),
                           ("allreduce_compression_fp16", allreduce_compression_fp16)):
        checks.add(name, function)
    for op in OPS:
        checks.add(f"grouped_allreduce/{op}", grouped_allreduce, op)
    for op in ("Sum", "Average"):
        checks.add(f"grouped_allreduce_scaled/{op}", grouped_allreduce_scaled, op)
    for op in ("Sum", "Max"):
        checks.add(f"grouped_allreduce_inplace/{op}", grouped_allreduce_inplace, op)


LARGE = [("float32", "Sum", "allreduce"), ("float64", "Sum", "allreduce"),
         ("float32", "Average", "allreduce"), ("bfloat16", "Average", "allreduce"),
         ("int32", "Max", "allreduce"), ("float32", "Sum", "allreduce_"),
         ("float64", "Average", "allreduce_async")]


def add_large_checks(checks: _harness.Checks) -> None:
    for d, op, form in LARGE:
        name = f"large_allreduce/{form}/{d}/{op}"
        checks.add(name, large_allreduce, d, op, _count(3 * MiB, d), form)


def add_segment_boundary_check(checks: _harness.Checks) -> None:
    """4 MiB + 1 float32 element at the default 1 MiB segment: every rank's block of the
    ring is a whole number of segments, give or take one element."""
    name = "large_allreduce/allreduce/float32/Sum/4MiB_plus_1"
    checks.add(name, large_allreduce, "float32", "Sum", _count(4 * MiB, "float32"))


# -- topology and barrier ---------------------------------------------------------------
def _launcher_says(*names: str) -> int | None:
    return next((int(os.environ[n]) for n in names if n in os.environ), None)


def _zombie_children() -> list[int]:
    """The children of this rank that have ended and not been reaped (``<defunct>``)."""
    zombies = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as listed:
            for pid in listed.read().split():
                try:
                    with open(f"/proc/{pid}/stat", "rb") as stat:
                        if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                            zombies.append(int(pid))
                except FileNotFoundError:  # reaped meanwhile
                    pass
    return zombies


def startup_leaves_no_zombie_child(key: str) -> None:
    """What psrt started while starting (the watcher of MPI's start-up) is reaped once it ends."""
    deadline = time.monotonic() + 30.0  # a hang guard: a zombie that is never reaped stays
    while (zombies := _zombie_children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not zombies, f"{key}: rank {hvd.rank()} keeps zombie children {zombies}"


def topology_single_host(key: str) -> None:
    rank, size = _rank_size()
    assert hvd.is_initialized() and (psrt.rank(), psrt.size()) == (rank, size)
    launcher = (_launcher_says("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"),
                _launcher_says("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
    assert launcher in ((rank, size), (None, None)), (
        f"{key}: (rank, size) = {(rank, size)}, the launcher says {launcher}")
    seen = (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    assert seen == (rank, size, 0, 1), (
        f"{key}: (local_rank, local_size, cross_rank, cross_size) = {seen}, expected "
        f"{(rank, size, 0, 1)} on one host")


def barrier_waits_for_every_rank(key: str) -> None:
    """No rank leaves the barrier before the last one (which arrives 0.3 s late) entered."""
    rank, size = _rank_size()
    hvd.barrier()
    if rank == size - 1:
        time.sleep(0.3)
    entered = time.time()
    hvd.barrier()
    left = time.time()
    times = psrt.runtime.current().topology.world.allgather_object((entered, left))
    last_entry = max(e for e, _ in times)
    early = [r for r, (_, exit_time) in enumerate(times) if exit_time < last_entry]
    assert not early, f"{key}: ranks {early} left the barrier before rank {size - 1} entered it"


def main() -> None:
    hvd.init()
    checks = _harness.Checks()
    if "--ring" in sys.argv:
        import _ring
        _ring.add_checks(checks)
        _crowded.add_checks(checks)
    else:
        checks.add("topology/single_host", topology_single_host)
        if os.path.isdir("/proc/self/task"):  # Linux
            checks.add("startup/no_zombie_child", startup_leaves_no_zombie_child)
        add_allreduce_checks(checks)
        _gather_scatter.add_checks(checks)
        _async_handles.add_checks(checks)
        checks.add("barrier/waits_for_every_rank", barrier_waits_for_every_rank)
        _process_sets.add_checks(checks)
        add_large_checks(checks)
        _crowded.add_checks(checks)
        add_segment_boundary_check(checks)  # last: it must not hide the other results
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
