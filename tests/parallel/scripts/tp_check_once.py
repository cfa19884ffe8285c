"""Tensor-parallel calls checked once per (collective, dtype, shape, op), over all ranks of the
job (TP = 2 or 4), as ``PSRT_TP_CHECK_SHAPES`` says by default; with
``PSRT_TP_CHECK_SHAPES=0`` the checks that a job without any check can run.

* a column- then row-parallel pair, three steps of forward and backward with one batch
  shape: the agreement runs on the first call of each shape only, and the outputs and
  gradients match the same layers in one process (same seed, same data);
* a rank whose batch is longer, a shape no rank used before, while the others' is known;
  and ranks whose batches differ though every shape is known (at 4 ranks: two known
  shapes and a new one): every rank raises the same CollectiveMismatchError, naming the
  ranks, the shapes and the line that called the layer, within seconds, and the set goes
  on working afterwards;
* without the check, no agreement at all.
"""
from __future__ import annotations

import time

import torch
from torch import nn

import _harness
import psrt.runtime
import psrt.torch as hvd
from _training_common import generator, randn
from psrt import tp
from psrt.errors import CollectiveMismatchError
from psrt.grid import ProcessGrid

BATCH, SEQ, DIM = 2, 8, 16
MISMATCH_WITHIN_S = 15.0  # the watchdog finds the blocked ranks a second or two in, then ends it
_GRID: list[ProcessGrid] = []


def grid() -> ProcessGrid:
    if not _GRID:
        _GRID.append(ProcessGrid(dp=1, tp=hvd.size(), pp=1))
    return _GRID[0]


def agreements() -> int:
    ps = grid().tp_set
    return ps.topology.direct(ps).agreements


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def check_repeats_agree_once(key: str, checking: bool) -> None:
    """Three steps with one shape: one agreement (the row layer's forward all-reduce and the
    column layer's backward one are the same call), none after; every output and gradient
    as in one process."""
    torch.manual_seed(generator(key).initial_seed())
    ps = grid().tp_set
    reference = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)).double()
    column = tp.ColumnParallelLinear(DIM, 4 * DIM, process_set=ps).double()
    row = tp.RowParallelLinear(4 * DIM, DIM, process_set=ps, input_is_parallel=True).double()
    tp.load_full_state_dict(column, reference[0].state_dict())
    tp.load_full_state_dict(row, reference[2].state_dict())
    counts, start = [], agreements()
    before = tp.stats().counts.get("all_reduce", 0)
    for step in range(3):
        x_full = randn(key, (BATCH, SEQ, DIM), "x", step).requires_grad_()
        x_mine = x_full.detach().clone().requires_grad_()  # so that the column layer's backward reduces
        weights = randn(key, (BATCH, SEQ, DIM), "R", step)
        want = reference(x_full)
        (want * weights).sum().backward()
        out = row(nn.functional.gelu(column(x_mine)))
        (out * weights).sum().backward()
        close(out.detach(), want.detach(), f"step {step} output")
        close(x_mine.grad, x_full.grad, f"step {step} input gradient")
        counts.append(agreements())
    assert tp.stats().counts.get("all_reduce", 0) - before == 6, "two all-reduces a step"
    assert counts == [start + checking] * 3, f"agreements after each step: {counts}, {start} before"
    close(row.weight.grad, row.weight.tp_sharding.shard(reference[2].weight.grad), "row weight gradient")
    close(column.weight.grad, column.weight.tp_sharding.shard(reference[0].weight.grad), "column weight gradient")
    close(column.bias.grad, column.bias.tp_sharding.shard(reference[0].bias.grad), "column bias gradient")


def expect_mismatch(layer: nn.Module, rows: int, fragments: list[str], what: str) -> None:
    """``layer`` on a batch of ``rows`` raises the same CollectiveMismatchError on every rank,
    naming every fragment, within seconds."""
    x = randn(what, (rows, DIM), "x")
    start = time.monotonic()
    try:
        layer(x)
    except CollectiveMismatchError as exc:
        message = str(exc)
    else:
        raise AssertionError(f"{what}: no CollectiveMismatchError")
    seconds = time.monotonic() - start
    missing = [f for f in fragments if f not in message]
    assert not missing, f"{what}: {message!r} does not mention {missing}"
    assert seconds < MISMATCH_WITHIN_S, f"{what}: took {seconds:.1f} s"
    everyone = hvd.allgather_object(message, name=f"{what}.message")
    assert len(set(everyone)) == 1, f"{what}: the ranks raised different errors: {everyone}"


def row_layer(key: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(generator(key).initial_seed())
    reference = nn.Linear(DIM, DIM).double()
    layer = tp.RowParallelLinear(DIM, DIM, process_set=grid().tp_set).double()
    tp.load_full_state_dict(layer, reference.state_dict())
    return layer, reference


def still_works(key: str, layer: nn.Module, reference: nn.Module, rows: int) -> None:
    x = randn(key, (rows, DIM), "after")
    close(layer(x).detach(), reference(x).detach(), "the layer after the mismatch")


def check_new_shape_at_a_known_call(key: str) -> None:
    """Every rank has run the layer on 2 rows; now rank 1 passes 3, a shape new to all."""
    layer, reference = row_layer(key)
    for _ in range(2):
        layer(randn(key, (2, DIM), "warm"))
    others = "ranks 0, 2-3 have" if hvd.size() == 4 else "rank 0 has"
    expect_mismatch(layer, 3 if hvd.rank() == 1 else 2,
                    [f"{others} all_reduce of a float64 tensor of shape (2, {DIM})",
                     f"but rank 1 has all_reduce of a float64 tensor of shape (3, {DIM})",
                     "called at tests/parallel/scripts/tp_check_once.py:"], key)
    still_works(key, layer, reference, 2)


def check_known_shapes_that_differ(key: str) -> None:
    """Every rank has run the layer on 2 and on 3 rows; now rank 0 passes 2, rank 1 passes 3
    and (at 4 ranks) the others 4, a shape new to all."""
    layer, reference = row_layer(key)
    for rows in (2, 3):
        layer(randn(key, (rows, DIM), "warm", rows))
    rows = 2 + min(hvd.rank(), 2)
    fragments = [f"rank 0 has all_reduce of a float64 tensor of shape (2, {DIM})",
                 f"rank 1 has all_reduce of a float64 tensor of shape (3, {DIM})"]
    if hvd.size() == 4:
        fragments.append(f"but ranks 2-3 have all_reduce of a float64 tensor of shape (4, {DIM})")
    expect_mismatch(layer, rows, fragments, key)
    still_works(key, layer, reference, 3)


def check_nothing_is_agreed(key: str) -> None:
    """PSRT_TP_CHECK_SHAPES=0: no call of any shape runs an agreement."""
    layer, reference = row_layer(key)
    for rows in (2, 2, 5):
        still_works(key, layer, reference, rows)
    assert agreements() == 0, f"{agreements()} agreements"


def main() -> None:
    hvd.init()
    checking = psrt.runtime.current().config.tp_check_shapes
    grid()
    checks = _harness.Checks()
    checks.add("repeats/agree_once_and_match_one_process", check_repeats_agree_once, checking)
    if checking:
        checks.add("mismatch/new_shape_at_a_known_call", check_new_shape_at_a_known_call)
        checks.add("mismatch/known_shapes_that_differ", check_known_shapes_that_differ)
    else:
        checks.add("unchecked/nothing_is_agreed", check_nothing_is_agreed)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
