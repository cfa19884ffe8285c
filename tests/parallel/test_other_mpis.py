"""psrt's core under MPICH and Intel MPI as well as Open MPI (which every other test uses).

Each MPI comes from PyPI (the ``mpich`` and ``impi-rt`` wheels, installed by ``make`` into
``.venv/mpis/NAME`` beside the Open MPI of the virtualenv, since all three install an
``mpirun``). psrun is pointed at that MPI's ``mpirun``, which is not on PATH (Intel MPI's is
a shell script that runs ``mpiexec.hydra`` from PATH: psrun runs it with its own directory
first), and must drive it in Hydra's dialect and make the ranks' mpi4py load that MPI's
library, not Open MPI's.

One job per behaviour and MPI, not the whole suite again: the collectives, the engine,
data-parallel training, the parameter server, ZeRO 1/2/3 and TP x PP check scripts
(each against its one-process reference, as in their own tests; TP x PP sampled; inside
job servers where tests/parallel runs them so), a rank killed and a rank frozen mid-training.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from collections.abc import Iterator

import pytest

from conftest import REPO
from job_server import CheckJobs
from faults import run_with_fault

pytestmark = pytest.mark.parallel

# The name of each MPI as psrun and MPI_Get_library_version report it.
MPIS = {"mpich": "MPICH", "impi": "Intel(R) MPI Library"}
# (script, ranks, environment): the core of tests/parallel, one job each.
CORE_JOBS = [
    ("collectives_check.py", 2, {}),
    ("engine_check.py", 2, {}),
    ("training_check.py", 2, {}),
    ("ps_check.py", 3, {"PSRT_NUM_SERVERS": "1"}),
    ("zero_check.py", 2, {}),
    ("gpt_check.py", 4, {"CHECKS_MATCHING": r"^gpt/dp1_tp2_pp2/1f1b$|^gpt/dp2_tp2_pp1/"}),
]
CHECK_S, SHUTDOWN_S = 2, 5
FAULT_ENV = {"PSRT_STALL_CHECK_TIME": str(CHECK_S), "PSRT_STALL_SHUTDOWN_TIME": str(SHUTDOWN_S)}


def mpirun(name: str) -> Path:
    """The ``mpirun`` of MPI ``name`` installed beside this virtualenv; skips if absent."""
    path = Path(sys.prefix) / "mpis" / name / "bin" / "mpirun"
    if not path.exists():
        pytest.skip(f"{MPIS[name]} is not installed at {path.parent.parent} (`make test` installs it there)")
    return path


@pytest.fixture(params=sorted(MPIS), scope="module")
def mpi(request: pytest.FixtureRequest) -> tuple[str, tuple[str, ...]]:
    """(the MPI's name, the psrun arguments that select it)."""
    return request.param, ("--mpirun", str(mpirun(request.param)))


def test_psrun_drives_the_mpi_and_ranks_load_its_library(mpi) -> None:
    name, psrun_args = mpi
    # one short line per rank, written at once, so that the ranks' lines cannot interleave
    probe = ("import sys; from mpi4py import MPI; world = MPI.COMM_WORLD; "
             "sys.stdout.write(f'{world.rank} {world.size} {MPI.Get_library_version().splitlines()[0]}\\n')")
    done = subprocess.run([sys.executable, "-m", "launcher.cli", *psrun_args, "-np", "2", sys.executable, "-c",
                           probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if re.match(r"^\d \d ", line))
    assert [line[:4] for line in lines] == ["0 2 ", "1 2 "], done.stdout
    assert all(MPIS[name] in line for line in lines), done.stdout


@pytest.fixture(scope="module")
def core_jobs(mpi) -> Iterator[CheckJobs]:
    """The core jobs under the MPI, as tests/parallel runs them (see job_server.py)."""
    jobs = CheckJobs(mpi[1])
    yield jobs
    jobs.close()


@pytest.mark.parametrize(("script", "np", "env"), CORE_JOBS, ids=[job[0].removesuffix(".py") for job in CORE_JOBS])
def test_core_checks_pass_under_the_mpi(mpi, core_jobs, script: str, np: int, env: dict[str, str]) -> None:
    name, _ = mpi
    report = core_jobs.get(script, np, env)
    assert report.returncode == 0 and report.done is not None, report.diagnosis()
    failed = {check: record["detail"] for check, record in report.records.items() if not record["ok"]}
    assert not failed, f"{script} under {MPIS[name]}: {failed}"
    assert report.done == len(report.order) > 0, report.diagnosis()


def test_a_killed_rank_ends_the_job_naming_it(mpi) -> None:
    """Killed by SIGSEGV, as by a crash in native code: Hydra kills the other ranks with
    SIGKILL, so the rank that died otherwise is the one to name (a SIGKILL'd rank may end in
    the same instant as those Hydra kills, and is then named with them: unit-tested)."""
    name, psrun_args = mpi
    job = run_with_fault("frozen_training.py", 2, ("dp",), FAULT_ENV, after="step 3", rank=1,
                         signum=signal.SIGSEGV, psrun_args=psrun_args)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < 10, job.diagnosis()
    assert "psrun: rank 1 failed first: killed by signal 11 (SIGSEGV)" in job.stderr, job.diagnosis()
    assert not job.left_behind, job.diagnosis()


def test_a_frozen_rank_is_named_and_the_job_ends(mpi) -> None:
    name, psrun_args = mpi
    job = run_with_fault("frozen_training.py", 2, ("dp",), FAULT_ENV, after="step 3", rank=1,
                         signum=signal.SIGSTOP, psrun_args=psrun_args)
    assert job.returncode not in (0, None), job.diagnosis()
    assert job.seconds_after_fault < SHUTDOWN_S + 8, job.diagnosis()  # probing, the abort, a busy machine
    assert "rank 1 does not respond" in job.stderr, job.diagnosis()
    assert re.search(r"psrun: rank 1 is to blame: stopped answering while rank 0's", job.stderr), job.diagnosis()
    assert not job.left_behind, job.diagnosis()


def test_mpi_without_thread_multiple_is_an_error_naming_the_mpi(mpi) -> None:
    name, psrun_args = mpi
    program = "import mpi4py; mpi4py.rc.thread_level = 'serialized'; import psrt.torch as hvd; hvd.init()"
    done = subprocess.run([sys.executable, "-m", "launcher.cli", *psrun_args, "-np", "2", sys.executable, "-c",
                           program], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert re.search(rf"{re.escape(MPIS[name])}.* provides thread level MPI_THREAD_SERIALIZED, but psrt needs "
                     "MPI_THREAD_MULTIPLE", done.stderr), done.stderr


def test_ranks_that_load_another_mpi_than_the_launchers_fail_naming_both() -> None:
    """MPICH's mpirun run by hand, while mpi4py finds the virtualenv's Open MPI first: each
    rank would be rank 0 of a job of one, training alone."""
    launcher = mpirun("mpich")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSRT_", "HOROVOD_", "MPI4PY_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    done = subprocess.run([str(launcher), "-n", "2", sys.executable, "-c", "import psrt.torch as hvd; hvd.init()"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode != 0
    assert re.search(r"started 2 ranks \(PMI_SIZE=2\), but the MPI this process loaded \(Open MPI v[\d.]+\) sees "
                     "a job of one rank", done.stderr), done.stderr
