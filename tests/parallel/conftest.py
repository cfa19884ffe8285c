"""The ``parallel_jobs`` fixture: each check-script job the tests ask for runs once per session,
with a hard timeout, and the tests assert on its individual checks (see check_jobs.py)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import pytest
from check_jobs import REPO, SCRIPTS, JobKey, JobReport, job_key, launch, run_together
from jobs import UNTUNED

__all__ = ["REPO", "SCRIPTS", "launch"]  # what test files import from here
os.environ.update(UNTUNED)  # for the tests that start psrun themselves (see jobs.UNTUNED)

#: The jobs each test file asks ``parallel_jobs`` for.  Those of the selected tests' files
#: that may share a job (see :func:`_shareable`) run together, one job server per rank count,
#: when the first of them is asked for; a job missing here still runs, in a job of its own.
JOBS_BY_FILE: dict[str, list[tuple[str, int, dict[str, str], tuple[str, ...]]]] = {
    "test_transport.py": [("transport_check.py", 2, {}, ()), ("transport_check.py", 4, {}, ())],
    "test_direct_across_ranks.py": [("direct_check.py", 2, {}, ())],
    "test_cp_ep.py": [(s, n, {}, ()) for s in ("cp_check.py", "ep_check.py") for n in (2, 4)],
    "test_plan_reality.py": [("plan_reality.py", 2, {}, ())],
    "test_horovod_compat.py": [("horovod_compat_check.py", 2, {}, ()), ("horovod_compat_check.py", 4, {}, ())],
    "test_autograd.py": [("autograd_check.py", 2, {}, ()), ("autograd_check.py", 4, {}, ())],
    "test_hierarchical.py": [("hierarchical_check.py", 4, {"PSRT_HIERARCHICAL_ALLREDUCE": "1"}, ())],
    "test_hf.py": [("hf_check.py", 2, {}, ()), ("hf_check.py", 4, {}, ())],
    "test_training.py": [("training_check.py", 2, {}, ()), ("training_check.py", 4, {}, ()),
                         ("training_check.py", 2, {"PSRT_FUSION_THRESHOLD": "0"}, ()),
                         ("training_check.py", 2, {"PSRT_FUSION_THRESHOLD": "1024"}, ())],
    "test_torch_backend.py": [("torch_backend_check.py", 2, {}, ()), ("torch_backend_check.py", 4, {}, ())],
    "test_zero.py": [("zero_check.py", 2, {}, ()), ("zero_check.py", 4, {}, ()), ("zero_gpt2_check.py", 2, {}, ())],
    "test_tp_pp.py": [("tp_check.py", 2, {}, ()), ("tp_check.py", 4, {}, ()), ("pp_check.py", 2, {}, ()),
                      ("pp_check.py", 4, {}, ()), ("gpt_check.py", 4, {}, ())],
    "test_engine.py": [("engine_check.py", 2, {}, ()), ("engine_check.py", 4, {}, ()),
                       ("engine_check.py", 2, {"PSRT_FUSION_THRESHOLD": "1024"}, ())],
    "test_collective_errors.py": [("errors_check.py", 2, {}, ()), ("errors_check.py", 4, {}, ())],
    "test_collectives.py": [(s, n, e, a) for n in (2, 4) for s, e, a in (
        ("collectives_check.py", {}, ()),
        ("collectives_check.py", {"PSRT_RING_THRESHOLD": "64", "PSRT_RING_SEGMENT": "64"}, ("--ring",)))],
}
#: Settings a job server can change between two scripts: only ``psrt.init()`` reads them.
#: (``PSRT_NUM_SERVERS`` cannot: parameter servers exit their process at shutdown.)
SERVER_SETTINGS = {"PSRT_FUSION_THRESHOLD", "PSRT_RING_THRESHOLD", "PSRT_RING_SEGMENT",
                   "PSRT_HIERARCHICAL_ALLREDUCE"}
#: Arguments a script reads only to choose its checks.  (engine_check.py's
#: ``--without-persistent-collectives`` changes a psrt module flag for the rest of the process.)
SERVER_ARGS = {(), ("--ring",)}
_wanted: list[JobKey] = []  # the shareable jobs of the selected tests' files, in a fixed order


def _shareable(key: JobKey) -> bool:
    return all(name in SERVER_SETTINGS for name, _ in key[2]) and key[3] in SERVER_ARGS


def pytest_collection_finish(session: pytest.Session) -> None:
    files = {Path(str(item.fspath)).name for item in session.items}
    keys = [job_key(*job) for name, jobs in JOBS_BY_FILE.items() if name in files for job in jobs]
    _wanted[:] = [key for key in dict.fromkeys(keys) if _shareable(key)]


class ParallelJobs:
    """Each distinct job runs once per session, on first use; shareable ones (see
    :data:`JOBS_BY_FILE`) together with the others of their rank count."""

    def __init__(self) -> None:
        self._reports: dict[JobKey, JobReport] = {}

    def get(self, script: str, np: int, env: Mapping[str, str] | None = None,
            args: tuple[str, ...] = ()) -> JobReport:
        key = job_key(script, np, env, args)
        if key not in self._reports:
            batch = [k for k in _wanted if k[1] == np and k not in self._reports]
            if key in batch and len(batch) > 1:
                self._reports.update(run_together(batch))
            else:
                self._reports[key] = launch(script, np, env, args)
        return self._reports[key]


@pytest.fixture(scope="session")
def parallel_jobs() -> ParallelJobs:
    return ParallelJobs()
