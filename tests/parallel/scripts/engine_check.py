"""The engine's behaviour across ranks, in one job: matching by name, poll, duplicate
names, fusion, mismatches after caching, join, barrier around async work, timeline.

Run on every rank (``psrun -np N python engine_check.py``); rank 0 prints one
JSON line per check (see ``_harness``).  Inputs are integer-valued floats, so
sums are exact whatever order or fusion the engine picks: results must equal
the reference exactly, whatever ``PSRT_FUSION_THRESHOLD`` the job runs with.
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
import zlib

import torch

import psrt
import psrt.comm.mpi
import psrt.runtime
import psrt.torch as hvd

import _harness
from _reference import assert_equal, expect_raises


def _inputs(key: str, count: int, shape=(5,), dtype=torch.float32) -> list[torch.Tensor]:
    """Every rank's integer-valued input for ``key``."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return [torch.randint(-50, 50, shape, generator=generator).to(dtype) for _ in range(count)]


def _sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(inputs).sum(0, dtype=inputs[0].dtype)


def names_in_rank_dependent_order(key: str) -> None:
    """Each rank submits the same names in its own order; all complete with the right sums."""
    rank, size = hvd.rank(), hvd.size()
    names = [f"{key}/{i}" for i in range(12)]
    inputs = {n: _inputs(n, size) for n in names}
    order = names[rank:] + names[:rank] if rank % 2 == 0 else names[::-1]
    handles = {n: hvd.allreduce_async(inputs[n][rank], name=n, op=hvd.Sum) for n in order}
    for n in reversed(order):
        assert_equal(hvd.synchronize(handles[n]), _sum(inputs[n]), f"{key} {n}")


def sync_call_while_other_async_pending(key: str) -> None:
    """Rank 0 starts A, then blocks in B; the others run B before A: names decide, not order."""
    rank, size = hvd.rank(), hvd.size()
    a, b = _inputs(key + "/a", size), _inputs(key + "/b", size)
    if rank == 0:
        handle = hvd.allreduce_async(a[rank], name=key + "/a", op=hvd.Sum)
        got_b = hvd.allreduce(b[rank], name=key + "/b", op=hvd.Sum)
        got_a = hvd.synchronize(handle)
    else:
        got_b = hvd.allreduce(b[rank], name=key + "/b", op=hvd.Sum)
        got_a = hvd.allreduce(a[rank], name=key + "/a", op=hvd.Sum)
    assert_equal(got_a, _sum(a), key + " A")
    assert_equal(got_b, _sum(b), key + " B")


def poll_is_false_until_every_rank_submitted(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = _inputs(key, size)
    if rank == 0:
        handle = hvd.allreduce_async(inputs[rank], name=key, op=hvd.Sum)
        polls = []
        for _ in range(5):
            polls.append(hvd.poll(handle))
            time.sleep(0.05)
        assert not any(polls), f"{key}: poll() was True before rank 1 submitted: {polls}"
        got = hvd.synchronize(handle)
        assert_equal(got, _sum(inputs), key)
    else:
        time.sleep(0.4)
        handle = hvd.allreduce_async(inputs[rank], name=key, op=hvd.Sum)
        got = hvd.synchronize(handle)
        assert_equal(got, _sum(inputs), key)


def duplicate_pending_name_raises_at_once(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = _inputs(key, size)
    if rank != 0:
        time.sleep(0.3)  # so that rank 0's first submission is surely still pending
    handle = hvd.allreduce_async(inputs[rank], name=key, op=hvd.Sum)
    if rank == 0:
        expect_raises(ValueError, lambda: hvd.allreduce_async(inputs[rank], name=key), key,
                      "already pending", what=key)
    assert_equal(hvd.synchronize(handle), _sum(inputs), key)
    # Once completed, the name may be used again.
    assert_equal(hvd.allreduce(inputs[rank], name=key, op=hvd.Sum), _sum(inputs), key + " again")


def unnamed_ops_match_by_counter(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    all_inputs = [_inputs(f"{key}/{i}", size) for i in range(5)]
    handles = [hvd.allreduce_async(inputs[rank], op=hvd.Sum) for inputs in all_inputs]
    for handle, inputs in zip(handles, all_inputs):
        assert_equal(hvd.synchronize(handle), _sum(inputs), key)


def many_small_tensors_fused(key: str) -> None:
    """200 tensors of mixed dtypes in flight at once (packed into fusion buffers)."""
    rank, size = hvd.rank(), hvd.size()
    dtypes = (torch.float32, torch.float64, torch.int32)
    cases = [(f"{key}/{i}", _inputs(f"{key}/{i}", size, (i % 7 + 1, 3), dtypes[i % 3]))
             for i in range(200)]
    handles = [(n, inputs, hvd.allreduce_async(inputs[rank].clone(), name=n, op=hvd.Sum))
               for n, inputs in cases]
    for n, inputs, handle in handles:
        assert_equal(hvd.synchronize(handle), _sum(inputs), n)


def views_of_one_buffer_reduced_in_place(key: str) -> None:
    """Tensors that are back-to-back views of one flat buffer (as gradient buckets are)."""
    rank, size = hvd.rank(), hvd.size()
    sizes = [3, 1, 8, 5, 2]
    everyone = _inputs(key, size, (sum(sizes),))
    flat = everyone[rank].clone()
    views = list(flat.split(sizes))
    handles = [hvd.allreduce_async_(v, name=f"{key}/{i}", op=hvd.Sum) for i, v in enumerate(views)]
    for i, handle in enumerate(handles):
        assert hvd.synchronize(handle) is views[i], f"{key}: allreduce_async_ returned a new tensor"
    assert_equal(flat, _sum(everyone), key)


def average_and_postscale_in_fused_batches(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    cases = [_inputs(f"{key}/{i}", size, (4,), torch.float64) for i in range(6)]
    handles = [hvd.allreduce_async(c[rank], name=f"{key}/{i}", op=hvd.Average,
                                   prescale_factor=2.0, postscale_factor=0.5)
               for i, c in enumerate(cases)]
    for i, (handle, c) in enumerate(zip(handles, cases)):
        want = _sum([x * 2.0 for x in c]) * 0.5 / size
        assert torch.allclose(hvd.synchronize(handle), want, rtol=1e-12), f"{key} {i}"


def mismatch_after_the_name_was_cached(key: str) -> None:
    """A name run twice (so it is in the response cache), then submitted with a different
    shape on the last rank: every rank raises, naming it; then it works again."""
    rank, size = hvd.rank(), hvd.size()
    for _ in range(2):
        hvd.allreduce(torch.ones(3), name=key, op=hvd.Sum)
    shape = (4,) if rank == size - 1 else (3,)
    start = time.monotonic()
    expect_raises(hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(shape), name=key),
                  key, "shape", f"rank {size - 1} has (4,)", what=key)
    assert time.monotonic() - start < 5, f"{key}: the mismatch took {time.monotonic() - start:.1f} s"
    assert_equal(hvd.allreduce(torch.ones(3), name=key, op=hvd.Sum), torch.full((3,), float(size)),
                 key + " afterwards")


def join_with_uneven_steps(key: str) -> None:
    """Rank r runs r + 1 steps, then joins: joined ranks contribute zeros, Average still
    divides by the full size, and every rank learns the last rank to join."""
    rank, size = hvd.rank(), hvd.size()
    for step in range(rank + 1):
        active = [r for r in range(size) if r >= step]
        got = hvd.allreduce(torch.full((3,), float(rank + 1)), name=key, op=hvd.Average)
        want = torch.full((3,), sum(r + 1.0 for r in active) / size)
        assert_equal(got, want, f"{key} step {step}")
    last = hvd.join()
    assert last == size - 1, f"{key}: join() returned {last}, expected {size - 1}"


def join_refuses_other_collectives(key: str) -> None:
    """After rank 0 joined, a broadcast on the others fails naming join (not a hang).  Which
    of the others joins last is a race: every rank must name the same one, and not rank 0."""
    rank, size = hvd.rank(), hvd.size()
    if rank == 0:
        last = hvd.join()
    else:
        expect_raises(RuntimeError, lambda: hvd.broadcast(torch.ones(2), root_rank=1, name=key),
                      key, "joined", what=key)
        last = hvd.join()
    assert last in range(1, size) or size == 1, f"{key}: join() returned {last}"
    assert len(set(hvd.allgather_object(last, name=key + ".last"))) == 1, f"{key}: the ranks name different last ranks"


def barrier_with_async_ops_outstanding(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    inputs = _inputs(key, size)
    handle = hvd.allreduce_async(inputs[rank], name=key, op=hvd.Sum)
    hvd.barrier()
    assert_equal(hvd.synchronize(handle), _sum(inputs), key)


def remove_process_set_refuses_while_its_ops_are_pending(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    process_set = hvd.add_process_set(list(range(size)))
    inputs = _inputs(key, size)
    if rank != 0:
        time.sleep(0.3)  # rank 0's operation is still pending when it tries to remove the set
    handle = hvd.allreduce_async(inputs[rank], name=key, op=hvd.Sum, process_set=process_set)
    if rank == 0:
        expect_raises(psrt.ProcessSetError, lambda: hvd.remove_process_set(process_set),
                      "still pending", key, what=key)
    assert_equal(hvd.synchronize(handle), _sum(inputs), key)
    hvd.remove_process_set(process_set)
    assert process_set.process_set_id is None, f"{key}: the set is still registered"


def mixed_blocking_and_async_in_random_orders(key: str) -> None:
    """10,000 calls per rank: in each batch of 20 names the blocking ones come in one order
    on every rank (as they must) and the asynchronous ones at places and in an order each
    rank draws for itself; every result is exact."""
    rank, size = hvd.rank(), hvd.size()
    shared, mine = random.Random(zlib.crc32(key.encode())), random.Random(rank)
    values = torch.arange(size, dtype=torch.float64)
    for batch in range(500):
        names = [f"{key}/{batch % 7}/{i}" for i in range(20)]  # names repeat: the cache applies
        blocking = [n for n in names if shared.random() < 0.3]
        calls = list(blocking)
        for n in names:
            if n not in blocking:
                calls.insert(mine.randrange(len(calls) + 1), n)
        handles = {}
        for n in calls:
            tensor = torch.full((1 + zlib.crc32(n.encode()) % 5,), values[rank] + batch)
            if n in blocking:
                assert_equal(hvd.allreduce(tensor, name=n, op=hvd.Sum), torch.full_like(tensor, values.sum()
                                                                                      + size * batch), n)
            else:
                handles[n] = hvd.allreduce_async_(tensor, name=n, op=hvd.Sum)
        for n in mine.sample(list(handles), len(handles)):
            got = hvd.synchronize(handles[n])
            assert_equal(got, torch.full_like(got, values.sum() + size * batch), f"{key} batch {batch} {n}")


def lone_cached_calls_meet_other_ranks_work(key: str) -> None:
    """A blocking call on a cached name with nothing else pending here takes the lone path
    (one round, then the reduction straight on the tensor) when nothing else is pending
    anywhere, and otherwise carries on as a full cycle: here rank 0 holds an asynchronous
    allreduce the others submit only after a blocking one, so their blocking call meets it
    in its round.  Every result is exact, and the others take both paths."""
    rank, size = hvd.rank(), hvd.size()
    negotiator = psrt.runtime.current().engine._cycle._negotiator
    lone_round, alone = negotiator.round_alone, []

    def counted(index, wait):
        result = lone_round(index, wait)
        alone.append(result is None)
        return result

    negotiator.round_alone = counted
    try:
        for _ in range(4):  # the same names each time: the first fills the response cache
            sync_call_while_other_async_pending(key)
        for i in range(20):
            got = hvd.allreduce(torch.full((3,), float(rank + i)), name=key + "/c", op=hvd.Average)
            assert_equal(got, torch.full((3,), (size - 1) / 2 + i), f"{key} C, call {i}")
    finally:
        del negotiator.round_alone
    assert True in alone, f"{key}: no call took the lone path"
    if rank != 0 and size > 1:
        assert False in alone, f"{key}: rank {rank}'s blocking call never met rank 0's pending work"


def express_calls_of_every_kind_are_exact(key: str) -> None:
    """Repeated blocking calls whose scale folds into the reduction run on the caller's
    thread (``Engine.express``): in place and into a new tensor, integer sums and maxima,
    floating Average and postscale; each must take that path after its first call and give
    the exact result every time.  A strided in-place tensor, an integer Average (rounded
    toward zero afterwards) and a prescaled call take the engine's own path, as exactly."""
    rank, size = hvd.rank(), hvd.size()
    negotiator = psrt.runtime.current().engine._cycle._negotiator
    express_round, taken = negotiator.round_alone, []

    def counted(index, wait):
        result = express_round(index, wait)
        taken.append(negotiator.cache.entries[index].name)
        return result

    def values(dtype, i):  # integer-valued; an odd total makes an integer Average round
        return torch.arange(-3, 3, dtype=dtype) * (rank + 1) - 2 * i - rank

    negotiator.round_alone = counted
    try:
        for i in range(6):
            everyone = [torch.arange(-3, 3) * (r + 1) - 2 * i - r for r in range(size)]
            total = torch.stack(everyone).sum(0)
            ints = values(torch.int64, i)
            assert_equal(hvd.allreduce_(ints, name=key + "/int-sum", op=hvd.Sum), total, f"{key} int sum {i}")
            assert_equal(ints, total, f"{key} int sum {i} in place")
            small = values(torch.int32, i)
            assert_equal(hvd.allreduce_(small, name=key + "/int-max", op=hvd.Max),
                         torch.stack(everyone).max(0).values.to(torch.int32), f"{key} int max {i}")
            floats = values(torch.float64, i)
            got = hvd.allreduce(floats, name=key + "/average", op=hvd.Average)
            assert_equal(got, total.double() / size, f"{key} average {i}")
            assert_equal(floats, values(torch.float64, i), f"{key} average {i} left its input alone")
            assert_equal(hvd.allreduce_(values(torch.float32, i), name=key + "/post", op=hvd.Sum,
                                        postscale_factor=0.5), total.float() * 0.5, f"{key} postscale {i}")
            strided = torch.zeros(6, 2, dtype=torch.float64)[:, 0]
            strided.copy_(values(torch.float64, i))
            hvd.allreduce_(strided, name=key + "/strided", op=hvd.Sum)
            assert_equal(strided, total.double(), f"{key} strided {i}")
            assert_equal(hvd.allreduce(values(torch.int64, i), name=key + "/int-average", op=hvd.Average),
                         torch.div(total, size, rounding_mode="trunc"), f"{key} int average {i}")
            assert_equal(hvd.allreduce(values(torch.float32, i), name=key + "/pre", op=hvd.Sum,
                                       prescale_factor=2.0), total.float() * 2, f"{key} prescale {i}")
    finally:
        del negotiator.round_alone
    express = {name.rsplit("/", 1)[1] for name in taken}
    assert express == {"int-sum", "int-max", "average", "post"}, f"{key}: express path taken by {sorted(express)}"
    assert len(taken) >= 4 * 4, f"{key}: only {len(taken)} calls took the express path"


def quiet_engines_hold_no_rounds_and_wake_when_rung(key: str) -> None:
    """Once no rank has work, no engine negotiates (the round count stands still); a rank
    without work of its own, busy elsewhere, is rung into the rounds another rank's
    collective needs (here: on a process set without it)."""
    rank, size = hvd.rank(), hvd.size()
    hvd.allreduce(torch.ones(1), name=key, op=hvd.Sum)
    negotiator = psrt.runtime.current().engine._cycle._negotiator
    before = negotiator.rounds
    time.sleep(0.3)
    assert negotiator.rounds == before, f"{key}: {negotiator.rounds - before} rounds while every engine was quiet"
    hvd.barrier()
    others = hvd.add_process_set(list(range(size - 1))) if size > 1 else None
    if rank < size - 1:
        start = time.monotonic()
        for i in range(20):
            assert_equal(hvd.allreduce(torch.ones(2), name=f"{key}/{i}", op=hvd.Sum, process_set=others),
                         torch.full((2,), float(size - 1)), key)
        assert time.monotonic() - start < 5, f"{key}: 20 allreduces took {time.monotonic() - start:.1f} s"
    else:
        time.sleep(0.5)  # no psrt call: only the doorbell brings this rank's engine into the rounds
    hvd.barrier()
    if others is not None:
        hvd.remove_process_set(others)


def a_late_member_is_left_to_compute(key: str) -> None:
    """A rank that is late for a collective it is a member of (still computing, say its
    backward) is not rung into rounds while the others wait: it holds none until it
    submits, and then the collective completes exactly."""
    rank, size = hvd.rank(), hvd.size()
    hvd.allreduce(torch.ones(1), name=key + "/warm", op=hvd.Sum)  # every engine goes quiet after it
    hvd.barrier()
    if rank == size - 1:
        negotiator = psrt.runtime.current().engine._cycle._negotiator
        before = negotiator.rounds
        time.sleep(0.3)  # the others are waiting in a round meanwhile
        assert negotiator.rounds == before, f"{key}: {negotiator.rounds - before} rounds while computing"
    got = hvd.allreduce(torch.full((2,), float(rank)), name=key, op=hvd.Sum)
    assert_equal(got, torch.full((2,), float(sum(range(size)))), key)


def timeline_records_each_phase(key: str) -> None:
    rank = hvd.rank()
    path = os.path.join(tempfile.gettempdir(), f"psrt-timeline-{os.getppid()}.json")
    hvd.start_timeline(path)
    # Separate tensors in one grouped work are always packed, so the copies show (separate
    # async allreduces are fused only if they happen to reach the same negotiation round).
    tensors = [torch.ones(i + 1) for i in range(4)]
    hvd.grouped_allreduce(tensors, name=f"{key}/0")
    hvd.broadcast(torch.ones(2), root_rank=0, name=key + "/broadcast")
    hvd.stop_timeline()
    if rank != 0:
        return
    with open(path) as f:
        trace = json.load(f)
    os.unlink(path)
    events = trace["traceEvents"]
    for event in events:
        missing = {"name", "ph", "pid", "tid"} - set(event)
        assert not missing, f"{key}: event {event} lacks {missing}"
        assert event["ph"] == "M" or "ts" in event, f"{key}: event {event} has no ts"
    phases = {e["name"] for e in events if e["ph"] == "X"}
    want = {"NEGOTIATE", "WAIT_FOR_OTHER_RANKS", "QUEUE", "ALLREDUCE", "BROADCAST"}
    if psrt.runtime.current().config.fusion_threshold > 0:
        want |= {"MEMCPY_IN_FUSION_BUFFER", "MEMCPY_OUT_FUSION_BUFFER"}
    assert want <= phases, f"{key}: phases {sorted(phases)} lack {sorted(want - phases)}"
    rows = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert f"{key}/0" in rows and f"{key}/broadcast" in rows, f"{key}: tensor rows {sorted(rows)}"


def main() -> None:
    if "--without-persistent-collectives" in sys.argv:
        # As on an MPI 3 library (Open MPI 4.1), which has no MPI_Allreduce_init.
        psrt.comm.mpi.PERSISTENT_COLLECTIVES = False
    psrt.init()
    checks = _harness.Checks()
    for name, function in [
        ("names_in_rank_dependent_order", names_in_rank_dependent_order),
        ("sync_call_while_other_async_pending", sync_call_while_other_async_pending),
        ("poll_is_false_until_every_rank_submitted", poll_is_false_until_every_rank_submitted),
        ("duplicate_pending_name_raises_at_once", duplicate_pending_name_raises_at_once),
        ("unnamed_ops_match_by_counter", unnamed_ops_match_by_counter),
        ("many_small_tensors_fused", many_small_tensors_fused),
        ("views_of_one_buffer_reduced_in_place", views_of_one_buffer_reduced_in_place),
        ("average_and_postscale_in_fused_batches", average_and_postscale_in_fused_batches),
        ("mismatch_after_the_name_was_cached", mismatch_after_the_name_was_cached),
        ("join_with_uneven_steps", join_with_uneven_steps),
        ("join_refuses_other_collectives", join_refuses_other_collectives),
        ("barrier_with_async_ops_outstanding", barrier_with_async_ops_outstanding),
        ("remove_process_set_refuses_while_its_ops_are_pending",
         remove_process_set_refuses_while_its_ops_are_pending),
        ("timeline_records_each_phase", timeline_records_each_phase),
        ("mixed_blocking_and_async_in_random_orders", mixed_blocking_and_async_in_random_orders),
        ("quiet_engines_hold_no_rounds_and_wake_when_rung", quiet_engines_hold_no_rounds_and_wake_when_rung),
        ("lone_cached_calls_meet_other_ranks_work", lone_cached_calls_meet_other_ranks_work),
        ("a_late_member_is_left_to_compute", a_late_member_is_left_to_compute),
        ("express_calls_of_every_kind_are_exact", express_calls_of_every_kind_are_exact),
    ]:
        checks.add(name, function)
    _harness.run(checks)


if __name__ == "__main__":
    main()
