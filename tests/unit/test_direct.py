"""The direct layer in one process: its header format, its cross-rank agreement check and
the waits it marks on the watchdog it is given, with ranks played by threads over an
in-memory communicator; and the spin-then-nap poll every psrt wait uses."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from psrt.comm import poll
from psrt.comm.base import Communicator, CompletedRequest, ElementwiseOp, Request
from psrt.comm.buffers import WIRE_DTYPES, dtype_code, dtype_of
from psrt.comm.direct import DirectGroup
from psrt.comm.header import HEADER_WORDS, MAX_DIMS, Header, Kind
from psrt.errors import CollectiveMismatchError, CommunicationError, InvalidArgumentError, PsrtError

_REDUCE = {ElementwiseOp.SUM: torch.add, ElementwiseOp.MAX: torch.maximum, ElementwiseOp.MIN: torch.minimum}


class _Hub:
    """What the thread-ranks of one fake group share: a rendezvous per collective and a
    mailbox per (source, destination, tag)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=10)
        self._slots: list[object] = [None] * size
        self.mail: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)
        self.lock = threading.Lock()

    def exchange(self, rank: int, value: object) -> list:
        self._slots[rank] = value
        self._barrier.wait()
        everyone = list(self._slots)
        self._barrier.wait()
        return everyone


class _Mail(Request):
    def __init__(self, hub: _Hub, key: tuple[int, int, int], into: torch.Tensor) -> None:
        self._hub, self._key, self._into, self._done = hub, key, into, False

    def test(self) -> bool:
        if not self._done:
            with self._hub.lock:
                box = self._hub.mail[self._key]
                if box:
                    self._into.copy_(box.popleft().view(self._into.shape))
                    self._done = True
        return self._done

    def wait(self) -> None:
        poll.wait_politely(self)

    def cancel(self) -> None:
        self._done = True


class ThreadComm(Communicator):
    """One thread-rank of a fake group; records the collectives it runs."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size
        self.calls: list[str] = []

    def allreduce(self, tensor, op, scale=1.0):
        self.iallreduce(tensor, op, scale)

    def iallreduce(self, tensor, op, scale=1.0):
        self.calls.append(f"allreduce {tensor.numel()} {str(tensor.dtype).removeprefix('torch.')}")
        everyone = self.hub.exchange(self.rank, tensor.clone())
        total = everyone[0]
        for other in everyone[1:]:
            total = _REDUCE[op](total, other)
        tensor.copy_(total * scale)
        return CompletedRequest()

    def allgatherv(self, send, recv, counts):
        self.calls.append("allgather")
        recv.copy_(torch.cat(self.hub.exchange(self.rank, send.clone())))
        return CompletedRequest()

    def reduce_scatter(self, send, recv, counts, op):
        self.calls.append("reduce_scatter")
        total = sum(self.hub.exchange(self.rank, send.clone()))
        start = sum(counts[:self.rank])
        recv.copy_(total[start:start + counts[self.rank]])
        return CompletedRequest()

    def allgather_object(self, obj):
        self.calls.append("allgather_object")
        return self.hub.exchange(self.rank, obj)

    def isend(self, tensor, dest, tag=0):
        with self.hub.lock:
            self.hub.mail[(self.rank, dest, tag)].append(tensor.clone())
        return CompletedRequest()

    def irecv(self, tensor, source, tag=0):
        return _Mail(self.hub, (source, self.rank, tag), tensor)

    def broadcast(self, tensor, root):
        raise NotImplementedError

    def alltoallv(self, send, send_counts, recv, recv_counts):
        raise NotImplementedError

    def barrier(self):
        raise NotImplementedError

    def exchange_counts(self, counts):
        raise NotImplementedError

    def split(self, color, key=0):
        raise NotImplementedError

    def free(self):
        pass


class RecordingWatchdog:
    """Stands in for :class:`psrt.comm.watchdog.Watchdog`: records every marked wait."""

    def __init__(self) -> None:
        self.waits: list[tuple[str, str, tuple, str]] = []

    def waiting(self, kind, what, world_peers=(), *, job_peers=(), ident=None, needs=None):
        record = self.waits

        class _Wait:
            def __enter__(self):
                text = what() if callable(what) else what
                peers, named = (world_peers, "world") if world_peers else (job_peers, "job")
                record.append((kind, text, tuple(peers), named))

            def __exit__(self, *exc):
                return None
        return _Wait()


def run_ranks(size: int, body: Callable[[DirectGroup], object], ranks: Sequence[int] | None = None,
              **group_options) -> tuple[list, list[ThreadComm], list[RecordingWatchdog]]:
    """``body(group)`` on ``size`` thread-ranks; returns what each returned (or raised)."""
    hub = _Hub(size)
    comms = [ThreadComm(hub, r) for r in range(size)]
    dogs = [RecordingWatchdog() for _ in range(size)]
    ranks = list(range(10, 10 + size)) if ranks is None else ranks
    groups = [DirectGroup(comms[r], ranks, dogs[r], key="test", name="the test set", **group_options) for r in range(size)]
    results: list = [None] * size

    def run(r: int) -> None:
        try:
            results[r] = body(groups[r])
        except PsrtError as e:  # collected: each rank's outcome is the claim checked
            results[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results, comms, dogs


# -- the header -----------------------------------------------------------------------------
def test_a_header_round_trips_through_its_sixteen_int64():
    tensor = torch.zeros(3, 4, dtype=torch.float16)
    header = Header.of(Kind.MESSAGE, tensor, ident=7_000_001, args=(5, 6))
    encoded = header.encode()
    assert encoded.dtype == torch.int64 and encoded.shape == (HEADER_WORDS,)
    back = Header.decode(encoded.tolist())
    assert (back.kind, back.ident, back.dtype, back.shape, back.args) == (Kind.MESSAGE, 7_000_001, torch.float16,
                                                                          (3, 4), (5, 6, 0, 0))
    assert back.complete and back.numel == 12


def test_a_header_of_a_deep_tensor_names_it_but_cannot_rebuild_it():
    deep = Header.decode(Header.of(Kind.ALL_REDUCE, torch.zeros((1,) * (MAX_DIMS + 1))).encode().tolist())
    assert deep.ndim == MAX_DIMS + 1 and not deep.complete
    assert deep.describe() == "all_reduce of a float32 tensor of shape (1, 1, 1, 1, 1, 1, 1, 1, ...)"


def test_headers_name_dtypes_by_the_one_wire_table():
    assert [dtype_of(dtype_code(d)) for d in WIRE_DTYPES] == list(WIRE_DTYPES)
    assert {torch.float16, torch.bfloat16, torch.bool, torch.int64} <= set(WIRE_DTYPES)
    odd = Header.decode(Header.of(Kind.ALL_GATHER, torch.zeros(5, dtype=torch.complex64)).encode().tolist())
    assert odd.dtype is None and not odd.complete
    assert odd.describe() == "all_gather of a another dtype tensor of shape (5,)"


def test_the_digest_is_the_same_in_every_process():
    """Ranks compare digests, so the digest must not depend on the process's hash seed."""
    code = ("import torch; from psrt.comm.header import Header, Kind; "
            "print(Header.of(Kind.ALL_REDUCE, torch.zeros(2, 3), args=(1,)).digest())")
    repo = Path(__file__).resolve().parents[2]
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(seen) == 1
    assert Header.of(Kind.ALL_REDUCE, torch.zeros(2, 3)).digest() != Header.of(Kind.ALL_REDUCE,
                                                                               torch.zeros(3, 2)).digest()


# -- the agreement check ----------------------------------------------------------------------
def test_equal_calls_cost_one_small_allreduce_besides_the_data():
    results, comms, _ = run_ranks(2, lambda g: g.all_reduce_(torch.full((4, 16), g.rank + 1.0), label="test"))
    assert all(torch.equal(r, torch.full((4, 16), 3.0)) for r in results)
    # the first collective compares the members' check setting once; then digest and data
    assert comms[0].calls == ["allgather_object", "allreduce 2 int64", "allreduce 64 float32"]


def test_disagreeing_calls_raise_the_same_error_on_every_rank_naming_both():
    results, comms, _ = run_ranks(2, lambda g: g.all_reduce_(torch.zeros(2 + g.rank, 16), label="tensor-parallel"))
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    assert str(results[0]) == ("tensor-parallel all_reduce over the test set: rank 10 has all_reduce of a float32 "
                               "tensor of shape (2, 16) but rank 11 has all_reduce of a float32 tensor of shape (3, 16)")
    assert "rank 11 has all_reduce of a float32 tensor of shape (3, 16) but rank 10 has" in str(results[1])
    assert "allgather" in comms[0].calls and not any(c.endswith("float32") for c in comms[0].calls)


def test_unchecked_calls_run_only_the_data_collective():
    def body(g: DirectGroup) -> list:
        g.all_reduce_(torch.ones(3), label="test", check=False)
        g.all_reduce_(torch.ones(3), label="test", check=False)
        return g.host.calls
    results, _, _ = run_ranks(2, body)
    assert results[0] == ["allgather_object", "allreduce 3 float32", "allreduce 3 float32"]


def test_members_that_disagree_on_checking_fail_alike_on_the_first_collective():
    results, _, _ = run_ranks(2, lambda g: g.all_reduce_(torch.ones(3), label="test", check=g.rank == 0))
    assert all(isinstance(r, CollectiveMismatchError) for r in results), results
    assert "rank 10 checks that every rank makes the same call but rank 11 does not" in str(results[1])


def test_gather_and_reduce_scatter_along_a_dim_match_one_process():
    full = torch.arange(24.0).reshape(2, 4, 3)
    gathered, _, _ = run_ranks(2, lambda g: g.all_gather(full.chunk(2, 1)[g.rank], 1, label="test"))
    assert all(torch.equal(r, full) for r in gathered)
    scattered, _, _ = run_ranks(2, lambda g: g.reduce_scatter(full * (g.rank + 1), 1, label="test"))
    assert [torch.equal(r, (full * 3).chunk(2, 1)[i]) for i, r in enumerate(scattered)] == [True, True]


def test_an_indivisible_reduce_scatter_fails_on_every_rank_after_agreeing():
    results, comms, _ = run_ranks(2, lambda g: g.reduce_scatter(torch.zeros(2, 3), 1, label="tensor-parallel"))
    assert all(isinstance(r, InvalidArgumentError) for r in results)
    assert "dimension 1 of a tensor of shape (2, 3) is not divisible by the tensor-parallel size 2" in str(results[0])
    assert comms[0].calls[-1] == "allreduce 2 int64"


# -- the watchdog it is given -----------------------------------------------------------------
def test_collectives_mark_their_wait_on_the_given_watchdog_naming_every_member():
    _, _, dogs = run_ranks(2, lambda g: g.all_reduce_(torch.ones(2), label="tensor-parallel"), ranks=[4, 6])
    assert dogs[1].waits == [("a tensor-parallel collective", "tensor-parallel all_reduce on rank 6 over the test set",
                              (4, 6), "world")]


def test_a_receive_marks_its_wait_on_the_sender_alone_and_returns_the_message():
    def body(g: DirectGroup):
        if g.rank == 0:
            g.send(torch.arange(6.0).reshape(2, 3), 1, tag=11, ident=42).wait()
            return None
        return g.recv(0, 11, kind="a pipeline message", what="rank 1's receive")
    results, _, dogs = run_ranks(2, body, ranks=[3, 5])
    header, tensor = results[1]
    assert header.ident == 42 and torch.equal(tensor, torch.arange(6.0).reshape(2, 3))
    # the header's wait (a call: it needs the sender) and the data's
    assert dogs[1].waits == [("a pipeline message", "rank 1's receive", (3,), "world")] * 2


def test_a_group_over_job_ranks_names_its_peers_as_job_ranks():
    results, _, dogs = run_ranks(2, lambda g: g.allgather_object(g.rank, label="parameter-server"), job_ranks=True)
    assert results == [[0, 1], [0, 1]]
    assert dogs[0].waits[0][2:] == ((10, 11), "job")


def test_a_message_a_header_cannot_describe_is_refused_before_sending():
    hub = _Hub(1)
    group = DirectGroup(ThreadComm(hub, 0), [0], RecordingWatchdog(), key="test")
    with pytest.raises(CommunicationError, match="at most 8 dimensions"):
        group.send(torch.zeros((1,) * 9), 0, tag=1)
    assert not hub.mail


# -- the poll ---------------------------------------------------------------------------------
@pytest.fixture
def idle_host(monkeypatch):
    """The polls below as on a host with cores to spare, whatever this one is doing."""
    monkeypatch.setattr(poll, "crowded", lambda: False)


class _AfterTests(Request):
    def __init__(self, tests: int) -> None:
        self.left = tests

    def test(self) -> bool:
        self.left -= 1
        return self.left < 0

    def wait(self) -> None:
        poll.wait_politely(self)

    def cancel(self) -> None:
        self.left = 0


def test_a_polite_wait_spins_first_then_naps_in_doubling_steps(monkeypatch, idle_host):
    naps: list[float] = []
    clock = iter(i * 1e-3 for i in range(1000))  # 1 ms a test: the spin is over at once
    monkeypatch.setattr(poll.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(poll.time, "sleep", naps.append)
    poll.wait_politely(_AfterTests(7))
    assert naps == [20e-6, 40e-6, 80e-6, 160e-6, 200e-6, 200e-6]


def test_a_polite_wait_on_a_quick_request_never_sleeps(monkeypatch, idle_host):
    monkeypatch.setattr(poll.time, "sleep", lambda s: pytest.fail("slept"))
    poll.wait_politely(_AfterTests(3))


def test_a_loop_that_does_work_spins_again_before_napping(monkeypatch, idle_host):
    naps: list[float] = []
    clock = iter(i * 1e-3 for i in range(1000))
    monkeypatch.setattr(poll.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(poll.time, "sleep", naps.append)
    backoff = poll.Backoff()
    for _ in range(3):
        backoff.idle()
    backoff.busy()
    for _ in range(2):
        backoff.idle()
    assert naps == [20e-6, 40e-6, 20e-6]


def test_on_a_crowded_host_a_polite_wait_naps_without_spinning(monkeypatch):
    """A quick request that an idle host's spin would catch costs a nap on a crowded one:
    the spin would only take the core the awaited rank needs."""
    naps: list[float] = []
    monkeypatch.setattr(poll, "crowded", lambda: True)
    monkeypatch.setattr(poll.time, "sleep", naps.append)
    poll.wait_politely(_AfterTests(3))
    assert naps == [20e-6, 40e-6]
