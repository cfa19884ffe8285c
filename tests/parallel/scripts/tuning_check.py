"""Tuning on 2 ranks, in one job run with PSRT_TUNE_FILE (no file yet) and PSRT_AUTOTUNE (see
test_tuning_job.py): the table measured at init, as a first job's, within a budget cut short
here, is the file's and every rank's, and the fixed threshold's above the sizes it measured; a table
written into the file is read by the next init and every rank sends each size by the
algorithm it names, with the single-process sums; the autotuner settles while every step's
sums stay right."""
from __future__ import annotations

import csv
import os
from pathlib import Path

import torch
from mpi4py import MPI

import _harness
import psrt
import psrt.torch as hvd
from psrt.comm import ring
from psrt.comm.mpi import library_version
from psrt.comm.tuning import measure
from psrt.comm.tuning.table import MARGIN, Band, TuningTable, read, write
from psrt.config import Config

KiB, MiB = 1 << 10, 1 << 20
#: The first job's measurement budget, cut short (1.5 s) so that on most machines it runs out
#: before the largest sizes: where it does, both ranks must stop at the same point.
BUDGET_S = 0.3
PATH = os.environ["PSRT_TUNE_FILE"]
SIZES = (4 * KiB, 256 * KiB, 2 * MiB, 8 * MiB)
# written into the file for the second init: each size of SIZES in a band of its own
WRITTEN = (Band(0, "mpi"), Band(128 * KiB, "ring"), Band(1 * MiB, "mpi"), Band(4 * MiB, "ring"))

rings = []  # the ring allreduces of this rank, by element count


def _counting(original):
    def ring_allreduce(comm, flat, *args, **kwargs):
        rings.append(flat.size)
        return original(comm, flat, *args, **kwargs)
    return ring_allreduce


ring.ring_allreduce = _counting(ring.ring_allreduce)


def check_measured_table_is_the_files_and_every_ranks(_: str) -> None:
    table = psrt.tuning_table()
    assert table.key is not None and not table.measured.startswith("fixed"), table.measured
    assert table.key.ranks == 2 and table.key.ranks_per_host == (2,) and table.key.mpi == library_version()
    assert read(Path(PATH), table.key) == table, "the file differs from the table in force"
    everyone = hvd.allgather_object(table.to_json())
    assert everyone[0] == everyone[1], "ranks hold different tables"
    rows = {row["bytes"]: row for row in table.measurements["allreduce"]}
    assert list(rows) == list(measure.SIZES[:len(rows)]), f"not the first sizes, smallest first: {list(rows)}"
    assert all(measure.REPEATS <= row["repeats"] <= measure.MAX_REPEATS for row in rows.values()), rows
    largest = max(rows, default=0)
    above = "ring" if largest and table.algorithm("allreduce", largest) == "ring" else None
    for nbytes in (n for n in measure.SIZES if n > largest):  # not measured: the ring goes on, or the fixed table
        fixed = "ring" if nbytes >= Config.ring_threshold else "mpi"
        assert table.algorithm("allreduce", nbytes) == (above or fixed), (nbytes, table.allreduce, rows)
    for band in table.allreduce:  # among the sizes measured, the ring starts at one where it clearly won
        if band.algorithm == "ring" and band.from_bytes <= largest:
            row = rows.get(band.from_bytes)
            assert row and row["ring_over_mpi"] <= 1 - MARGIN and row["ring_faster"] >= 0.75 * row["repeats"], \
                (band, rows)


def check_sizes_go_by_the_written_table(_: str) -> None:
    measured = psrt.tuning_table()
    hvd.shutdown()
    if MPI.COMM_WORLD.rank == 0:
        write(Path(PATH), TuningTable(measured.key, WRITTEN, measured="written by the test"))
    MPI.COMM_WORLD.Barrier()
    os.environ["PSRT_TUNE"] = "auto"  # read the file
    hvd.init()
    table = psrt.tuning_table()
    assert table.allreduce == WRITTEN, f"the second init did not read the written table: {table.allreduce}"
    for nbytes in SIZES:
        rings.clear()
        tensor = torch.arange(nbytes // 4, dtype=torch.float32) * (hvd.rank() + 1)
        hvd.allreduce_(tensor, op=hvd.Sum, name=f"tuned.{nbytes}")
        want = torch.arange(nbytes // 4, dtype=torch.float32) * 3
        assert torch.allclose(tensor, want, rtol=1e-6), f"{nbytes} bytes: wrong sum"
        used = "ring" if rings == [nbytes // 4] else "mpi" if not rings else f"rings {rings}"
        assert used == table.algorithm("allreduce", nbytes), f"{nbytes} bytes went by {used} on rank {hvd.rank()}"
        assert hvd.allgather_object(used) == [used, used]


def check_autotune_settles_with_every_step_right(_: str) -> None:
    grads = [torch.full((1000 * (i + 1),), float(hvd.rank() + 1)) for i in range(6)]
    for step in range(40):
        handles = [hvd.allreduce_async_(g, name=f"grad.{i}", op=hvd.Sum) for i, g in enumerate(grads)]
        for i, handle in enumerate(handles):
            hvd.synchronize(handle)
            assert bool((grads[i] == 3.0).all()), f"step {step}: gradient {i} wrong"
            grads[i].fill_(hvd.rank() + 1)
    if hvd.rank() == 0:
        rows = list(csv.DictReader(open(os.environ["HOROVOD_AUTOTUNE_LOG"])))
        assert rows and rows[-1]["phase"] == "settled", f"no settled row in {rows[-3:]}"


def main() -> None:
    measure.FIRST_JOB_BUDGET_S = BUDGET_S
    hvd.init()  # no table in PATH yet: measures within the budget and writes PATH
    checks = _harness.Checks()
    checks.add("tuning/measured_table_is_the_files_and_every_ranks", check_measured_table_is_the_files_and_every_ranks)
    checks.add("tuning/autotune_settles_with_every_step_right", check_autotune_settles_with_every_step_right)
    checks.add("tuning/sizes_go_by_the_written_table", check_sizes_go_by_the_written_table)
    _harness.run(checks, check_timeout_s=60.0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
