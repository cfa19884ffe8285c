"""Real multi-host jobs through psrun: two "hosts" (network namespaces, see netns.py) reached
with ``--launch-agent`` over ``--network-cidr``, whose interfaces are named differently.

Training across the hosts must give what the same job gives on one host: data-parallel,
TP 2 x PP 2 and parameter-server jobs, with 2 ranks per host, compared rank by rank
(losses and each rank's parameters). A remote rank that dies must end the job with psrun
naming it; a partitioned host must end the job with a stall report naming its ranks.
Every rank's torchrun variables (``RANK``, ``LOCAL_RANK``, ...) say where it ran. Nothing of a job
listens beyond loopback and the hosts' interface but the MPI launcher, whose sockets psrun's note
names; on one host no rank opens a TCP listener at all. Launches are few, since every rank imports
torch.
"""
from __future__ import annotations

import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest
from listener_checks import assert_only_the_noted_launcher_listens
from training_records import assert_same_training, assert_torchrun_places, one_host, results

pytestmark = pytest.mark.parallel

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "cross_host_job.py")
JOB_TIMEOUT_S = 180.0
# Open MPI ends a job within about a second of a rank's death; allow for a busy machine.
PROMPT_END_S = 15.0
STALL_CHECK_S, STALL_SHUTDOWN_S = 3, 8
# torchrun's variables psrun's rank wrapper sets on every host, from the launcher's (init() sets the node's)
FROM_THE_WRAPPER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class Jobs:
    """Each correctness job runs once per module, on first use, on the test bed and on one host."""

    def __init__(self, testbed, one_host) -> None:
        self.testbed, self.one_host = testbed, one_host
        self._done: dict[tuple, dict] = {}
        self.output: dict[tuple, str] = {}  # stdout and psrun's stderr of the two-host jobs

    def get(self, where: str, parts: str, np: int, *extra: str) -> dict:
        key = (where, parts, np, extra)
        if key not in self._done:
            if where == "one host":
                self._done[key] = one_host(("-np", str(np), *extra), (parts,))
            else:
                env = {"PSRT_STALL_CHECK_TIME": "60"}  # any PSRT_ setting, to see it forwarded
                job = self.testbed.psrun("-np", str(np), *extra, sys.executable, JOB, parts, slots=2, env=env)
                self._done[key] = results(job, job.finish(JOB_TIMEOUT_S))
                self.output[key] = f"{job.out}\n{job.err}"
        return self._done[key]


@pytest.fixture(scope="module")
def jobs(testbed, one_host) -> Jobs:
    return Jobs(testbed, one_host)


def test_data_parallel_training_across_two_hosts_matches_one_host(jobs, testbed) -> None:
    two = jobs.get("two hosts", "dp,gpt", 4)
    hosts = [two["dp", rank]["host"] for rank in range(4)]
    # Ranks 2 and 3 ran on the second host, started by the agent from a bare environment,
    # and got from psrun what they need: PATH, PYTHONPATH and the PSRT_ settings.
    assert hosts == [socket.gethostname()] * 2 + [testbed.hosts[1].namespace] * 2
    here = two["dp", 0]["env"]
    assert here["PSRT_STALL_CHECK_TIME"] == "60" and here["PYTHONPATH"] and here["PATH"]
    assert [two["dp", rank]["env"] for rank in (2, 3)] == [here, here]
    assert_torchrun_places(two, "dp", 4, FROM_THE_WRAPPER)
    assert_same_training(two, jobs.get("one host", "dp,gpt", 4), "dp", 4)


def test_nothing_listens_beyond_the_hosts_interface_but_the_launcher_psrun_names(jobs) -> None:
    """Every process of the two-host job (psrun, its lifeline, prterun, the agent and prted on
    the second host, the ranks of both): the test bed's addresses are all loopback ones
    (127.200.0.0/24), so what binds every address is what remains: prterun and prted, named by
    psrun's note, and Open MPI's btl tcp in every rank, which the note says binds every address."""
    jobs.get("two hosts", "dp,gpt", 4)
    sockets = assert_only_the_noted_launcher_listens(jobs.output["two hosts", "dp,gpt", 4, ()], ranks_noted=True)
    assert {s["program"] for s in sockets if s["exposed"] and s["role"] == "launcher"} == {"prterun", "prted"}


def test_tp2_pp2_gpt_across_two_hosts_matches_one_host(jobs) -> None:
    assert_same_training(jobs.get("two hosts", "dp,gpt", 4), jobs.get("one host", "dp,gpt", 4), "gpt", 4)


def test_parameter_server_across_two_hosts_matches_one_host(jobs, testbed) -> None:
    # 3 ranks, 2 on the first host: the server is its rank 1, worker 2 is on the second host.
    two = jobs.get("two hosts", "ps", 3, "--num-servers", "1")
    assert two["ps", 1]["host"] == testbed.hosts[1].namespace
    # torchrun's variables count the workers alone (worker 1 is rank 1 of 2, alone on its host),
    # so only init(), which picks the servers, sets them
    assert_torchrun_places(two, "ps", 2, ())
    assert_same_training(two, jobs.get("one host", "ps", 3, "--num-servers", "1"), "ps", 2)


def test_killed_remote_rank_is_named_and_ends_the_job(testbed) -> None:
    job = testbed.psrun("-np", "2", sys.executable, JOB, "dp", "--steps", "1000", "--step-sleep", "0.05",
                        "--kill-rank", "1", "--kill-step", "5", slots=1)
    code = job.finish(JOB_TIMEOUT_S)
    assert code not in (0, None) and "killing rank 1 at " in job.out, job.diagnosis()
    killed_at = float(job.out.split("killing rank 1 at ")[1].split()[0])
    assert job.err.splitlines()[-1] == "psrun: rank 1 failed first: killed by signal 9 (SIGKILL)", \
        job.diagnosis()
    took = job.ended_at - killed_at
    print(f"remote rank killed: the job ended {took:.1f} s later")
    assert took < PROMPT_END_S, job.diagnosis()


def test_partitioned_host_ends_the_job_with_a_stall_naming_its_ranks(testbed) -> None:
    env = {"PSRT_STALL_CHECK_TIME": str(STALL_CHECK_S), "PSRT_STALL_SHUTDOWN_TIME": str(STALL_SHUTDOWN_S)}
    job = testbed.psrun("-np", "2", sys.executable, JOB, "dp", "--steps", "100000", "--step-sleep", "0.05",
                        slots=1, env=env)
    try:
        job.wait_for_line(r"^step 5$", JOB_TIMEOUT_S)
        testbed.partition(testbed.hosts[1])
        cut_at = time.time()
        code = job.finish(STALL_SHUTDOWN_S + 60)
    finally:
        job.stop()
    took = job.ended_at - cut_at
    print(f"partition: the job ended {took:.1f} s after the link went down (exit code {code})")
    assert code is not None, f"the job was still running {STALL_SHUTDOWN_S + 60} s after the partition"
    # probing, the abort, and psrun ending an mpirun that cannot reach the cut-off host (5 s + 3 s)
    assert took < STALL_SHUTDOWN_S + 15, job.diagnosis()
    summary = job.err.strip().splitlines()[-1]
    assert summary.startswith("psrun: rank 1 is to blame: stopped answering while "), job.diagnosis()
    assert summary.endswith("(reported by rank 0)"), job.diagnosis()
    assert "rank 1 does not respond (stopped, hung, or cut off from this host)" in job.err + job.log, job.diagnosis()


LISTENERS = """\
    import os, sys, time
    sys.path.insert(0, SCRIPTS)
    from mpi4py import MPI
    import _listeners

    world = MPI.COMM_WORLD
    world.allreduce(world.rank)  # the transports are up
    if world.rank == 0:
        print(_listeners.snapshot_line(), flush=True)
    deadline = time.monotonic() + 60  # a hang guard: the test lets the job end once psrun's note is out
    while not os.path.exists(GO) and time.monotonic() < deadline:
        time.sleep(0.1)
    world.barrier()
"""


def test_single_host_ranks_open_no_tcp_listener(one_host, tmp_path) -> None:
    """Without remote hosts, psrun keeps Open MPI's ranks on shared memory: before, every
    rank's TCP transport listened on all addresses (0.0.0.0 and ::) for the whole job.  What
    does listen beyond loopback is prterun's, and psrun's note names it."""
    script, go = tmp_path / "listeners.py", tmp_path / "go"
    scripts = Path(__file__).resolve().parents[1] / "parallel" / "scripts"
    script.write_text(f"SCRIPTS, GO = {str(scripts)!r}, {str(go)!r}\n" + textwrap.dedent(LISTENERS))
    job = one_host("-np", "2", sys.executable, str(script))
    try:
        job.wait_for_line("^listeners: ", 60)
        deadline = time.monotonic() + 60
        while "psrun: note:" not in job.err and job.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        go.touch()
    assert job.finish(60) == 0, job.diagnosis()
    sockets = assert_only_the_noted_launcher_listens(f"{job.out}\n{job.err}")
    assert [s for s in sockets if s["role"] == "rank"] == [], sockets
