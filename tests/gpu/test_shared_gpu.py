"""Two and four ranks sharing one GPU (scripts/shared_gpu_check.py): psrt carries their CUDA
tensors through host memory, and every collective, DP, PS, ZeRO 1/2/3, TP × PP, CP, EP and
the elastic state must match one process on the CPU.  One job per rank count (PS in its own,
with one server), one test per part of it.

Skips cleanly where no GPU is present."""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from _gpu_jobs import psrun  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "shared_gpu_check.py"
PARTS = ("collectives", "dp", "zero", "tp_pp", "cp", "ep", "elastic")


@functools.cache
def job(np: int, ps: bool) -> tuple[dict[str, dict], str]:
    """The checks one job reported (by name), and its output for a failure's message."""
    layout = ("-np", str(np + 1), "--num-servers", "1") if ps else ("-np", str(np))
    done = psrun(*layout, sys.executable, str(SCRIPT), "--parts", "ps" if ps else ",".join(PARTS), timeout_s=400)
    records = {}
    for line in done.stdout.splitlines():
        if line.startswith('{"check"'):
            record = json.loads(line)
            records[record["check"]] = record
    return records, f"exit code {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("part", PARTS + ("ps",))
@pytest.mark.parametrize("np", [2, 4])
def test_ranks_sharing_one_gpu_match_one_process(np, part):
    records, output = job(np, part == "ps")
    mine = {name: record for name, record in records.items() if name.startswith(f"{part}/")}
    assert mine, f"no {part} check reported at {np} ranks: {output}"
    failed = {name: record["detail"] for name, record in mine.items() if not record["ok"]}
    assert not failed, failed
