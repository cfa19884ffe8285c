"""Tuning at 2 ranks, one job (``scripts/tuning_check.py``) with a ``PSRT_TUNE_FILE`` in a
temporary directory and ``PSRT_AUTOTUNE=1``: the table a first job measures at init, within
its time budget, is written to the file and held alike by every rank; a table written into the file is
read at the next init and each size goes by the algorithm it names on both ranks, with the
single-process sums; the autotuner settles while every step's sums stay right."""
from __future__ import annotations

import json

import pytest
from conftest import launch

pytestmark = pytest.mark.parallel

CHECKS = ["tuning/measured_table_is_the_files_and_every_ranks", "tuning/autotune_settles_with_every_step_right",
          "tuning/sizes_go_by_the_written_table"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    where = tmp_path_factory.mktemp("tuning")
    env = {"PSRT_TUNE": "auto", "PSRT_TUNE_FILE": str(where / "table.json"), "PSRT_AUTOTUNE": "1",
           "HOROVOD_AUTOTUNE_LOG": str(where / "autotune.csv"), "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
           "PSRT_AUTOTUNE_STEPS_PER_SAMPLE": "2"}
    return launch("tuning_check.py", 2, env), where


@pytest.mark.parametrize("check", CHECKS)
def test_tuning_checks(job, check):
    job[0].assert_ok(check)


def test_the_file_holds_the_table_the_last_init_read(job):
    table = json.loads((job[1] / "table.json").read_text())
    assert table["measured"] == "written by the test" and table["key"]["ranks"] == 2


def test_the_tuning_job_ran_every_check(job):
    job[0].assert_complete(CHECKS)
