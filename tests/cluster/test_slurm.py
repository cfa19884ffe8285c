"""psrt on a real SLURM cluster (two nodes, each a network namespace of its own; see slurm.py).

Training submitted with ``sbatch`` (the script users are shown: examples/slurm/psrun.sbatch)
and ``salloc`` runs ``psrun`` with no hosts given, so psrun must take them from the
allocation; ``srun`` starts the ranks itself, through PMIx for Open MPI and PMI-2 for MPICH.
Each job trains the parts of ``tests/multihost/cross_host_job.py`` on 2 nodes x 2 ranks and
must match the same job on one host, rank by rank. A node that dies mid-job must end the
job naming the node and a rank on it; ``scancel`` must end a job cleanly, leaving no rank
behind on either node.

The bed's hosts talk over 127.200.0.0/24, which Open MPI leaves out by default: the jobs'
environment says to use it (``OMPI_MCA_btl_tcp_if_include``, ``PRTE_MCA_oob_tcp_if_include``),
as a site's module file would name its cluster network.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multihost"))
from jobs import REPO  # noqa: E402
from netns import SUBNET  # noqa: E402
from training_records import assert_same_training, assert_torchrun_places, one_host, records  # noqa: E402

pytestmark = pytest.mark.parallel

JOB = str(REPO / "tests" / "multihost" / "cross_host_job.py")
SBATCH_SCRIPT = REPO / "examples" / "slurm" / "psrun.sbatch"
JOB_TIMEOUT_S = 180.0
LONG_RUN = ("--steps", "100000", "--step-sleep", "0.05")
# What every job gets: this virtualenv's python and psrun first on PATH, psrt importable,
# and the bed's network for Open MPI (a site's cluster network; 127/8 is excluded by default).
JOB_ENV = {
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    "PYTHONPATH": str(REPO),
    "OMPI_MCA_btl_tcp_if_include": str(SUBNET),
    "PRTE_MCA_oob_tcp_if_include": str(SUBNET),
    # a hang ends in a stall report naming the ranks, well within the tests' time limit
    "PSRT_STALL_CHECK_TIME": "10", "PSRT_STALL_SHUTDOWN_TIME": "40",
}


def submit(cluster, *args: str, env: dict[str, str] | None = None) -> tuple[str, Path]:
    """``sbatch`` the users' script with ``args``; returns the job id and its output file."""
    output = cluster.workdir / f"sbatch-{time.monotonic_ns()}.out"
    done = cluster.run("sbatch", "--parsable", f"--output={output}", str(SBATCH_SCRIPT), *args,
                       env={**JOB_ENV, **(env or {})})
    return done.stdout.strip().split(";")[0], output


def finished_output(cluster, job_id: str, output: Path) -> str:
    state = cluster.wait_for_job(job_id, JOB_TIMEOUT_S)
    text = output.read_text(errors="replace") if output.exists() else ""
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{text[-3000:]}\n{cluster.logs()}"
    return text


def wait_for_line(output: Path, pattern: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if output.exists() and re.search(pattern, output.read_text(errors="replace"), re.MULTILINE):
            return
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} in {output} within {timeout_s:g} s:\n"
                         f"{output.read_text(errors='replace')[-3000:] if output.exists() else '(no output)'}")


def ranks_left(cluster) -> list[str]:
    """Python processes (ranks) still alive on any node of the cluster."""
    found = []
    for host in cluster.bed.hosts:
        for pid in cluster.pids_on(host.namespace):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(part.endswith(b"cross_host_job.py") for part in command):
                found.append(f"{host.namespace}: pid {pid}")
    return found


@pytest.fixture(scope="module")
def reference() -> dict:
    """One host's data-parallel and TP 2 x PP 2 training, 4 ranks."""
    return one_host(("-np", "4"), ("dp,gpt",))


def test_sbatch_script_trains_across_both_nodes_like_one_host(cluster, reference) -> None:
    job_id, output = submit(cluster, JOB, "dp,gpt")
    found = records(finished_output(cluster, job_id, output))
    assert [found["dp", rank]["host"] for rank in range(4)] == [cluster.nodes[0]] * 2 + [cluster.nodes[1]] * 2
    assert_torchrun_places(found, "dp", 4, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))  # psrun's
    assert_same_training(found, reference, "dp", 4)
    assert_same_training(found, reference, "gpt", 4)


def test_salloc_runs_psrun_with_the_allocations_hosts_for_parameter_servers(cluster) -> None:
    env = {"PSRT_NUM_SERVERS": "1"}
    done = cluster.run("salloc", "--nodes=2", "--ntasks-per-node=2", "psrun", "python", JOB, "ps",
                       env={**JOB_ENV, **env}, timeout_s=JOB_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    found = records(done.stdout)
    assert {record["host"] for record in found.values()} == set(cluster.nodes), found.keys()
    assert_torchrun_places(found, "ps", 3, ())  # the workers', set by init()
    assert_same_training(found, one_host(("-np", "4", "--num-servers", "1"), ("ps",)), "ps", 3)


@pytest.mark.parametrize("mpi", ["pmix", "pmi2"])
def test_srun_starts_the_ranks_itself_and_they_train_like_one_host(cluster, reference, mpi) -> None:
    """PMIx for the virtualenv's Open MPI; PMI-2 for MPICH (its library given to mpi4py)."""
    env = dict(JOB_ENV)
    if mpi == "pmi2":
        library = Path(sys.prefix) / "mpis" / "mpich" / "lib" / "libmpi.so.12"
        if not library.exists():
            pytest.skip(f"MPICH is not installed at {library.parent.parent} (`make test` installs it there)")
        env["MPI4PY_LIBMPI"] = str(library)
    # One output file per rank: srun cuts the merged output of several tasks into 1 KiB pieces.
    outputs = cluster.workdir / f"srun-{mpi}"
    outputs.mkdir()
    done = cluster.run("srun", f"--mpi={mpi}", "--nodes=2", "--ntasks-per-node=2", f"--output={outputs}/%t.out",
                       "python", JOB, "dp", env=env, timeout_s=JOB_TIMEOUT_S, check=False)
    text = "\n".join(path.read_text(errors="replace") for path in sorted(outputs.glob("*.out")))
    assert done.returncode == 0, f"{text[-2000:]}\n{done.stderr[-3000:]}"
    found = records(text)
    assert [found["dp", rank]["host"] for rank in range(4)] == [cluster.nodes[0]] * 2 + [cluster.nodes[1]] * 2
    # import psrt.torch took srun's (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS); init() the rest
    assert_torchrun_places(found, "dp", 4, ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    assert_same_training(found, reference, "dp", 4)


def test_scancel_ends_the_job_cleanly(cluster) -> None:
    job_id, output = submit(cluster, JOB, "dp", *LONG_RUN)
    wait_for_line(output, r"^step 5$", JOB_TIMEOUT_S)
    cluster.run("scancel", job_id)
    cancelled_at = time.monotonic()
    state = cluster.wait_for_job(job_id, 60)
    took = time.monotonic() - cancelled_at
    print(f"scancel: job {job_id} ended {state} {took:.1f} s later")
    assert state == "CANCELLED", output.read_text(errors="replace")[-3000:]
    deadline = time.monotonic() + 10
    while (left := ranks_left(cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"ranks left behind after scancel: {left}"


def test_a_node_that_dies_mid_job_ends_it_naming_the_node_and_its_rank(cluster) -> None:
    """Last: the node comes back (its slurmd restarted) but SLURM may still hold it down."""
    job_id, output = submit(cluster, JOB, "dp", *LONG_RUN)
    try:
        wait_for_line(output, r"^step 5$", JOB_TIMEOUT_S)
        cluster.kill_node(1)
        died_at = time.monotonic()
        wait_for_line(output, r"^psrun: rank ", 60)  # not the note on listeners psrun gives at start
        took = time.monotonic() - died_at
    finally:
        cluster.revive_node(1, wait=False)
    text = output.read_text(errors="replace")
    # SLURM marks the job FAILED once it has heard from the lost node or given up on it.
    state = cluster.wait_for_state(job_id, ("COMPLETING", "FAILED", "NODE_FAIL"), 30)
    print(f"node died: psrun ended the job {took:.1f} s later; SLURM: {state}")
    summary = [line for line in text.splitlines() if line.startswith("psrun: ")][-1]
    assert summary.startswith("psrun: rank 2 failed first: ") and f"host {cluster.nodes[1]} " in summary \
        and "ranks 2, 3 ran there" in summary, text[-3000:]
    assert took < 15, text[-3000:]
