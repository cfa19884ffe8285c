"""Checks of the direct layer over real MPI (``psrun -np 2 python direct_check.py``): the
agreement check across processes, the check setting compared on a group's first
collective, a reduction of 16-bit floats, and messages whose header rebuilds the tensor.
Every rank must raise alike where a check expects an error: none is left waiting."""
from __future__ import annotations

import _harness
import torch
from _training_common import expect_raises

import psrt.runtime
import psrt.torch as hvd
from psrt.comm.direct import DirectGroup
from psrt.errors import CollectiveMismatchError

LABEL = "direct-check"


def group(ranks: list[int] | None = None) -> DirectGroup:
    """The direct group of a fresh process set (its first collective settles the check setting)."""
    process_set = hvd.add_process_set(ranks or list(range(hvd.size())))
    return psrt.runtime.current().topology.direct(process_set)


def check_disagreeing_dtypes_are_named_on_every_rank(key: str) -> None:
    g = group()
    mine = torch.zeros(4, 2, dtype=torch.float64 if g.rank == 1 else torch.float32)
    other = "float32" if g.rank == 1 else "float64"
    expect_raises(CollectiveMismatchError, lambda: g.all_reduce_(mine, label=LABEL),
                  f"has all_reduce of a {other} tensor of shape (4, 2)", "float64 on rank 1 only")
    total = g.all_reduce_(torch.ones(4, 2), label=LABEL)  # the group is still usable
    assert torch.equal(total, torch.full((4, 2), float(g.size))), total


def check_a_check_setting_on_some_ranks_only_fails_alike(key: str) -> None:
    g = group()
    expect_raises(CollectiveMismatchError, lambda: g.all_reduce_(torch.ones(3), label=LABEL, check=g.rank == 0),
                  "checks that every rank makes the same call but rank 1 does not", "check on rank 0 only")


def check_bfloat16_all_reduce_and_gather_match_one_process(key: str) -> None:
    g = group()
    x = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4) * (g.rank + 1)
    total = g.all_reduce_(x.clone(), label=LABEL)
    want = sum(torch.arange(8, dtype=torch.float32).reshape(2, 4) * (r + 1) for r in range(g.size))
    assert torch.equal(total, want.to(torch.bfloat16)), total
    gathered = g.all_gather(x, 1, label=LABEL)
    assert gathered.shape == (2, 4 * g.size) and torch.equal(gathered[:, 4 * g.rank:4 * g.rank + 4], x)


def check_a_message_header_rebuilds_the_tensor(key: str) -> None:
    g = group()
    peer = 1 - g.rank
    sent = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4) + g.rank
    request = g.send(sent, peer, tag=5, ident=100 + g.rank)
    header, got = g.recv(peer, 5, kind="a direct-check message", what="the peer's message")
    request.wait()
    assert header.ident == 100 + peer and got.dtype == torch.float16, header.words()
    assert torch.equal(got, torch.arange(24, dtype=torch.float16).reshape(2, 3, 4) + peer), got


def main() -> None:
    hvd.init()
    checks = _harness.Checks()
    checks.add("agreement/disagreeing_dtypes_named_on_every_rank", check_disagreeing_dtypes_are_named_on_every_rank)
    checks.add("agreement/check_setting_on_one_rank_fails_alike", check_a_check_setting_on_some_ranks_only_fails_alike)
    checks.add("collectives/bfloat16_matches_one_process", check_bfloat16_all_reduce_and_gather_match_one_process)
    checks.add("messages/header_rebuilds_the_tensor", check_a_message_header_rebuilds_the_tensor)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
