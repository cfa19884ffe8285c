"""Calls checked once per (collective, dtype, shape, op) (:mod:`psrt.comm.keyed`) and the
ending of a mismatch between them (:mod:`psrt.comm.breaker`), in one process: ranks are
threads over in-memory communicators, one per channel, so that calls on different channels
really never meet; the watchdog's part (deadlock detection, probes) is played by the test."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from test_direct import ThreadComm, _Hub

from psrt.comm import deadlock
from psrt.comm.base import ElementwiseOp
from psrt.comm.breaker import BREAK_WITHIN_S, Breaker
from psrt.comm.deadlock import DIRECT, Call
from psrt.comm.direct import DirectGroup
from psrt.comm.keyed import CHECK, CHECKED, ONCE
from psrt.comm.waits import Wait, WaitStack
from psrt.errors import CollectiveMismatchError, PsrtError

LABEL = "tensor-parallel"


class ChannelComm(ThreadComm):
    """A thread-rank whose split makes a new in-memory communicator (a hub of its own)."""

    def split(self, color, key=0):
        hub = self.hub.exchange(self.rank, _Hub(self.size))[0]  # rank 0's, for every rank
        return ChannelComm(hub, self.rank)


class BlockWatchdog:
    """Marks waits as the real watchdog does (so the test can read each thread-rank's blocked
    call) and holds a breaker that watches every thread."""

    def __init__(self) -> None:
        self.breaker = Breaker(watched_thread=None)
        self.stack = WaitStack()

    def waiting(self, kind, what, world_peers=(), *, job_peers=(), ident=None, needs=None):
        return Wait(kind, what, world_peers or job_peers, 0.0, None, None, self.stack, ident=ident, needs=needs)

    def blocked_call(self, rank: int) -> Call | None:
        wait = self.stack[-1] if self.stack else None
        if wait is None or wait.ident is None:
            return None
        return Call(rank, wait.ident, wait.since, time.monotonic() - wait.since, wait.peer_ranks(), None, True,
                    wait.describe(), f"model.py:{rank + 10}", "", True)


class Ranks:
    """``size`` thread-ranks, each with a direct group checking calls once."""

    def __init__(self, size: int, capacity: int | None = None) -> None:
        hub = _Hub(size)
        self.dogs = [BlockWatchdog() for _ in range(size)]
        self.groups = [DirectGroup(ChannelComm(hub, r), range(size), self.dogs[r], key="tp", name="the TP set")
                       for r in range(size)]
        if capacity is not None:
            for group in self.groups:
                group._known._capacity = capacity

    def run(self, body: Callable[[DirectGroup], object], *, breaking: bool = False) -> list:
        """``body(group)`` on every thread-rank; what each returned or raised.  With
        ``breaking``, once every rank is blocked, play each rank's watchdog: find the
        deadlock, hand it to the breakers and answer their probes until the ranks are done."""
        results: list = [None] * len(self.groups)

        def run(r: int) -> None:
            try:
                results[r] = body(self.groups[r])
            except PsrtError as e:
                results[r] = e
        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.groups))]
        for thread in threads:
            thread.start()
        if breaking:
            self._break(threads)
        for thread in threads:
            thread.join(timeout=30)
        assert not any(thread.is_alive() for thread in threads), "a thread-rank never finished"
        return results

    def _break(self, threads: list[threading.Thread]) -> None:
        calls: dict[int, Call] = {}
        deadline = time.monotonic() + 5
        while len(calls) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.05)
            calls = {r: call for r, dog in enumerate(self.dogs) if (call := dog.blocked_call(r)) is not None}
        ranks = deadlock.find(0, calls)
        assert ranks == list(range(len(threads))), f"no deadlock among {calls}"
        for r, dog in enumerate(self.dogs):
            assert dog.breaker.take(r, ranks, calls, time.monotonic()), f"rank {r} would not end the mismatch"
        prober = _Prober(self.dogs)
        while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline + 10:
            for dog in self.dogs:
                assert dog.breaker.step(time.monotonic(), prober) is None
            time.sleep(0.01)


class _Prober:
    """Every rank's answer is its breaker's status, at once."""

    def __init__(self, dogs: list[BlockWatchdog]) -> None:
        self._dogs = dogs

    def ask(self, ranks) -> None:
        pass

    def answers(self) -> dict[int, tuple[float, dict]]:
        return {r: (time.monotonic(), {"breaking": dog.breaker.status()}) for r, dog in enumerate(self._dogs)}


def traced(g: DirectGroup, call: str, run: Callable[[], object]) -> tuple[bool, int]:
    """Run one collective ``call`` of ``g``: whether it ran an agreement, and the path its data took."""
    before = g.agreements
    run()
    return g.agreements > before, g._marks[(LABEL, call, threading.get_ident())].ident[3]


# -- equal calls ------------------------------------------------------------------------------
def test_repeated_calls_run_the_agreement_once_per_call_and_match_one_process():
    full = torch.arange(24.0).reshape(2, 4, 3)

    def body(g: DirectGroup) -> tuple[list, list]:
        out, trace = [], []
        for _ in range(4):
            trace.append(traced(g, "all_reduce", lambda: out.append(
                g.all_reduce_(full * (g.rank + 1), label=LABEL, check=ONCE))))
            trace.append(traced(g, "all_gather", lambda: out.append(
                g.all_gather(full.chunk(2, 1)[g.rank], 1, label=LABEL, check=ONCE))))
            trace.append(traced(g, "reduce_scatter", lambda: out.append(
                g.reduce_scatter(full * (g.rank + 1), 1, label=LABEL, check=ONCE))))
        return out, trace
    ranks = Ranks(2)
    results = ranks.run(body)
    for r, (out, trace) in enumerate(results):
        assert all(torch.equal(t, full * 3) for t in out[0::3])
        assert all(torch.equal(t, full) for t in out[1::3])
        assert all(torch.equal(t, (full * 3).chunk(2, 1)[r]) for t in out[2::3])
        # checked the first time only; each call's data on its own channel
        assert trace == [(True, 0), (True, 1), (True, 2)] + [(False, 0), (False, 1), (False, 2)] * 3
    for group in ranks.groups:
        assert group.agreements == 3, "one agreement per (collective, dtype, shape, op)"
        # the host carried the comparison of the setting and three digests, the channels the data
        assert group.host.calls == ["allgather_object"] + ["allreduce 2 int64"] * 3


def test_equal_calls_take_equal_paths_on_every_rank():
    def body(g: DirectGroup) -> list:
        return [traced(g, "all_reduce", lambda: g.all_reduce_(torch.ones(shape), label=LABEL, check=ONCE))
                for shape in [(4,), (5,), (4,), (4, 1), (5,), (4,)]]
    traces = Ranks(3).run(body)
    assert traces[0] == traces[1] == traces[2]
    assert traces[0] == [(True, 0), (True, 1), (False, 0), (True, 2), (False, 1), (False, 0)]


def test_an_op_is_part_of_the_call():
    def body(g: DirectGroup) -> tuple:
        first = traced(g, "all_reduce", lambda: g.all_reduce_(torch.ones(3), label=LABEL, check=ONCE))
        out = torch.full((3,), g.rank + 1.0)
        second = traced(g, "all_reduce", lambda: g.all_reduce_(out, ElementwiseOp.MAX, label=LABEL, check=ONCE))
        return first, second, out.tolist()
    assert Ranks(2).run(body) == [((True, 0), (True, 1), [2.0] * 3)] * 2


def test_unchecked_calls_run_only_their_data():
    ranks = Ranks(2)
    ranks.run(lambda g: [g.all_reduce_(torch.ones(3), label=LABEL, check=False) for _ in range(3)])
    assert ranks.groups[0].agreements == 0
    assert ranks.groups[0].host.calls == ["allgather_object"] + ["allreduce 3 float32"] * 3


def test_empty_tensors_are_checked_every_call():
    ranks = Ranks(2)
    ranks.run(lambda g: [g.all_reduce_(torch.ones(0, 4), label=LABEL, check=ONCE) for _ in range(3)])
    assert ranks.groups[0].agreements == 3


def test_past_the_channels_a_new_call_is_checked_every_time_and_runs_on_the_host():
    def body(g: DirectGroup) -> list:
        return [traced(g, "all_reduce", lambda: g.all_reduce_(torch.ones(n), label=LABEL, check=ONCE))
                for n in (2, 3, 2, 3)]
    assert Ranks(2, capacity=1).run(body) == [[(True, 0), (True, CHECKED), (False, 0), (True, CHECKED)]] * 2


def test_calls_off_the_watched_thread_are_checked_every_time():
    ranks = Ranks(2)
    for dog in ranks.dogs:
        dog.breaker.watched_thread = threading.main_thread().ident  # the thread-ranks are not it
    ranks.run(lambda g: [g.all_reduce_(torch.ones(3), label=LABEL, check=ONCE) for _ in range(3)])
    assert ranks.groups[0].agreements == 3


def test_members_that_differ_in_how_they_check_fail_alike_on_the_first_collective():
    results = Ranks(2).run(lambda g: g.all_reduce_(torch.ones(3), label=LABEL, check=ONCE if g.rank else True))
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    assert ("rank 0 checks that every rank makes the same call but rank 1 checks each new call once"
            in str(results[1]))


# -- calls that differ ------------------------------------------------------------------------
def all_reduce(shape) -> Callable[[DirectGroup], torch.Tensor]:
    return lambda g: g.all_reduce_(torch.ones(shape), label=LABEL, check=ONCE)


def raised_alike(results: list) -> str:
    """The one message every rank raised."""
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    assert len({str(r) for r in results}) == 1, [str(r) for r in results]
    return str(results[0])


def test_a_new_shape_on_one_rank_at_a_known_call_is_the_same_error_on_every_rank():
    ranks = Ranks(2)
    ranks.run(all_reduce((4, 8)))
    results = ranks.run(lambda g: all_reduce((4, 8) if g.rank == 0 else (5, 8))(g), breaking=True)
    assert raised_alike(results) == (
        "tensor-parallel collectives over the TP set: rank 0 has all_reduce of a float32 tensor of shape (4, 8) "
        "(called at model.py:10) but rank 1 has all_reduce of a float32 tensor of shape (5, 8) (called at "
        "model.py:11) (a call agreed on before is not checked again: the ranks were found blocked on the channels "
        "of different calls)")
    # the group goes on: the known call still unchecked, the other still new
    assert ranks.run(all_reduce((4, 8)))[0].tolist() == [[2.0] * 8] * 4
    ranks.run(all_reduce((5, 8)))
    assert [g.agreements for g in ranks.groups] == [1 + 1 + 1, 1 + 1 + 1]  # (4, 8); rank 1's or the dummy; (5, 8)


def test_two_known_shapes_on_different_ranks_are_the_same_error_on_every_rank():
    ranks = Ranks(2)
    ranks.run(all_reduce((4, 8)))
    ranks.run(all_reduce((2, 8)))
    message = raised_alike(ranks.run(lambda g: all_reduce((4, 8) if g.rank == 0 else (2, 8))(g), breaking=True))
    assert "rank 0 has all_reduce of a float32 tensor of shape (4, 8)" in message
    assert "but rank 1 has all_reduce of a float32 tensor of shape (2, 8)" in message
    assert ranks.run(all_reduce((2, 8)))[1].tolist() == [[2.0] * 8] * 2


def test_four_ranks_on_four_paths_of_every_collective_all_end_with_the_same_error():
    """Three known calls of three collectives and a new one: each rank joins the three
    other paths, in one order, with buffers of their calls."""
    def known(g: DirectGroup, which: int):
        if which == 0:
            return g.all_reduce_(torch.ones(4), label=LABEL, check=ONCE)
        if which == 1:
            return g.all_gather(torch.ones(2), 0, label=LABEL, check=ONCE)
        if which == 2:
            return g.reduce_scatter(torch.ones(8), 0, label=LABEL, check=ONCE)
        return g.all_reduce_(torch.ones(7), label=LABEL, check=ONCE)
    ranks = Ranks(4)
    for which in range(3):
        ranks.run(lambda g: known(g, which))
    message = raised_alike(ranks.run(lambda g: known(g, g.rank), breaking=True))
    assert ("rank 0 has all_reduce of a float32 tensor of shape (4,) (called at model.py:10), rank 1 has all_gather "
            "of a float32 tensor of shape (2,) (called at model.py:11), rank 2 has reduce_scatter of a float32 tensor "
            "of shape (8,) (called at model.py:12) but rank 3 has all_reduce of a float32 tensor of shape (7,)") in message
    for which in range(3):  # every channel is still in step on every rank
        results = ranks.run(lambda g: known(g, which))
    assert [t.tolist() for t in results] == [[4.0] * 2] * 4


def test_an_op_differing_at_a_known_call_is_the_same_error_naming_the_op():
    ranks = Ranks(2)
    ranks.run(all_reduce(3))
    message = raised_alike(ranks.run(lambda g: g.all_reduce_(torch.ones(3), ElementwiseOp.MAX if g.rank else
                                                             ElementwiseOp.SUM, label=LABEL, check=ONCE),
                                     breaking=True))
    assert "but rank 1 has all_reduce (max) of a float32 tensor of shape (3,)" in message


def test_a_rank_joins_another_path_only_once_its_ranks_said_they_are_ending_the_mismatch():
    """Else a rank's blocked call could complete, with the dummy buffers' data, before its own
    watchdog marked it failed, and return that data."""
    ranks = Ranks(2)
    ranks.run(all_reduce(4))
    results: list = [None, None]

    def run(r: int) -> None:
        try:
            all_reduce(4 if r == 0 else 5)(ranks.groups[r])
        except PsrtError as e:
            results[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    calls = {r: ranks.dogs[r].blocked_call(r) for r in range(2)}
    first, second = ranks.dogs[0].breaker, ranks.dogs[1].breaker
    prober = _Prober(ranks.dogs)
    assert first.take(0, [0, 1], calls, time.monotonic())
    for _ in range(20):  # rank 1 has not found the deadlock yet: rank 0 must not join its path
        assert first.step(time.monotonic(), prober) is None
        time.sleep(0.01)
    assert all(thread.is_alive() for thread in threads) and results == [None, None]
    assert second.take(1, [0, 1], calls, time.monotonic())
    deadline = time.monotonic() + 5
    while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
        first.step(time.monotonic(), prober)
        second.step(time.monotonic(), prober)
        time.sleep(0.01)
    raised_alike(results)


# -- what the breaker leaves to the deadlock report -------------------------------------------
def synthetic(ranks: Ranks, idents: dict[int, tuple]) -> dict[int, Call]:
    members = tuple(range(len(ranks.groups)))
    return {r: Call(r, ident, 0.0, 2.0, members, None, True, "a call", "", "", True) for r, ident in idents.items()}


@pytest.mark.parametrize("case", ["same_path", "another_group", "checked_every_call", "not_every_member",
                                  "another_collective"])
def test_a_deadlock_that_is_no_mismatch_of_calls_agreed_once_is_left_to_the_report(case):
    ranks = Ranks(3)
    ranks.run(all_reduce(2))
    gid = ranks.groups[0]._known.ident
    idents = {0: (DIRECT, gid, 2, 0), 1: (DIRECT, gid, 2, 0), 2: (DIRECT, gid, 2, CHECK, "1,0,6,1,3")}
    if case == "same_path":
        idents[2] = (DIRECT, gid, 2, 0)
    elif case == "another_group":
        idents[2] = (DIRECT, "pp of ranks (0, 1, 2)", 2, 0)
    elif case == "checked_every_call":
        idents[2] = (DIRECT, gid, 2)
    elif case == "not_every_member":
        del idents[2]
    else:
        idents[2] = (DIRECT, gid, 3, 0)
    calls = synthetic(ranks, idents)
    assert not ranks.dogs[0].breaker.take(0, sorted(calls), calls, 0.0)
    assert ranks.dogs[0].breaker.status() is None and ranks.groups[0]._known.broken is None


def test_a_mismatch_not_ended_in_time_is_reported_as_a_deadlock():
    ranks = Ranks(2)
    ranks.run(all_reduce(2))
    gid = ranks.groups[0]._known.ident
    calls = synthetic(ranks, {0: (DIRECT, gid, 2, 0), 1: (DIRECT, gid, 2, CHECK, "1,0,6,1,3")})
    breaker = ranks.dogs[0].breaker
    assert breaker.take(0, [0, 1], calls, 100.0)
    silent = type("Silent", (), {"ask": lambda self, ranks: None, "answers": lambda self: {}})()
    assert breaker.step(101.0, silent) is None and breaker.status() == [gid, 2]
    assert breaker.step(100.0 + BREAK_WITHIN_S + 1, silent) == ([0, 1], calls)
