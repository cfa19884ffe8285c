"""Real jobs under psrun: success, failed ranks named and ended promptly, Ctrl-C passed on.

Each job runs psrun in a subprocess with a hard timeout. Failing ranks print
the time just before they fail, so "the job ended promptly" is measured from
the failure itself, not from a start-up that a busy machine can make slow.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from jobs import psrun_argv, start_job, take_log

pytestmark = pytest.mark.parallel

REPO = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 60
# Open MPI ends a job about 0.3 s after a rank dies; allow for a loaded machine.
PROMPT_END_S = 5.0

BLOCKED_RANK_0 = """\
import os, sys, time
from mpi4py import MPI
world = MPI.COMM_WORLD
print(f"rank {world.rank} up", flush=True)
if world.rank == 1:
    print(f"failing at {time.time()}", flush=True)
    FAIL
world.barrier()  # rank 0 stays here: only the launcher can end it
"""


def psrun(*args: str, script: str | None = None, tmp_path: Path | None = None,
          env: dict[str, str] | None = None, keep_log: bool = False) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``psrun args [python script]``; returns the result and the time it ended. The log
    psrun writes of a failed job is removed unless ``keep_log``."""
    argv = [sys.executable, "-m", "launcher.cli", *args]
    if script is not None:
        assert tmp_path is not None
        path = tmp_path / "job.py"
        path.write_text(textwrap.dedent(script))
        argv += [sys.executable, str(path)]
    run_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    done = subprocess.run(argv, cwd=REPO, env=run_env, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S, check=False)
    ended = time.time()
    if not keep_log:
        take_log(done.stderr)
    return done, ended


def failed_at(stdout: str) -> float:
    line = next(line for line in stdout.splitlines() if line.startswith("failing at "))
    return float(line.split()[-1])


def test_two_rank_job_succeeds_and_sees_psrt_environment(tmp_path: Path) -> None:
    script = """\
        import os
        from mpi4py import MPI
        world = MPI.COMM_WORLD
        total = world.allreduce(world.rank + 1)
        print(f"rank {world.rank}/{world.size} sum={total} fusion={os.environ['PSRT_FUSION_MB']}", flush=True)
    """
    done, _ = psrun("-np", "2", "--verbose", script=script, tmp_path=tmp_path,
                    env={"PSRT_FUSION_MB": "7"})
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["rank 0/2 sum=3 fusion=7", "rank 1/2 sum=3 fusion=7"]
    assert "-x PSRT_FUSION_MB" in done.stderr


def test_four_ranks_oversubscribe_two_cores_with_warning(tmp_path: Path) -> None:
    script = """\
        from mpi4py import MPI
        MPI.COMM_WORLD.barrier()
        print("rank", MPI.COMM_WORLD.rank, flush=True)
    """
    done, _ = psrun("-np", "4", script=script, tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"rank {r}" for r in range(4)]
    if (os.cpu_count() or 1) < 4:
        assert "psrun: warning: 4 ranks on" in done.stderr and "--oversubscribe" in done.stderr


def test_rank_exit_code_ends_job_and_is_propagated(tmp_path: Path) -> None:
    done, ended = psrun("-np", "2", script=BLOCKED_RANK_0.replace("FAIL", "os._exit(3)"),
                        tmp_path=tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines()[-1] == "psrun: rank 1 failed first: exited with code 3"
    assert ended - failed_at(done.stdout) < PROMPT_END_S


def test_rank_killed_by_signal_is_named(tmp_path: Path) -> None:
    done, ended = psrun("-np", "2", script=BLOCKED_RANK_0.replace("FAIL", "os.kill(os.getpid(), 9)"),
                        tmp_path=tmp_path)
    assert done.returncode != 0
    assert done.stderr.splitlines()[-1] == "psrun: rank 1 failed first: killed by signal 9 (SIGKILL)"
    assert ended - failed_at(done.stdout) < PROMPT_END_S


def test_uncaught_exception_names_rank_and_exception(tmp_path: Path) -> None:
    # psrt.init() installs the hook that prints "psrt: rank R failed: ..." and aborts.
    script = """\
        import time
        import psrt
        psrt.init()
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 1:
            print(f"failing at {time.time()}", flush=True)
            raise ValueError("boom")
        MPI.COMM_WORLD.barrier()
    """
    done, ended = psrun("-np", "2", script=script, tmp_path=tmp_path)
    assert done.returncode != 0
    assert "ValueError: boom" in done.stderr  # the rank's own traceback still shows
    assert done.stderr.splitlines()[-1] == "psrun: rank 1 failed first: raised ValueError: boom"
    assert ended - failed_at(done.stdout) < PROMPT_END_S


def test_uncaught_exception_shows_even_under_torch_distributed_hook(tmp_path: Path) -> None:
    # torch.distributed started after psrt wraps the excepthook and captures stderr to print
    # it later, which the abort used to prevent: the job ended with no traceback and no reason.
    script = """\
        import socket
        import psrt
        import torch.distributed as dist
        psrt.init()
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        port = None
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.rank,
                                world_size=comm.size)
        if comm.rank == 1:
            raise ValueError("boom under gloo")
        comm.barrier()
    """
    done, _ = psrun("-np", "2", script=script, tmp_path=tmp_path)
    assert done.returncode != 0
    assert "ValueError: boom under gloo" in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == "psrun: rank 1 failed first: raised ValueError: boom under gloo", done.stderr


def test_ctrl_c_is_passed_to_mpirun_and_ends_the_job(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text(textwrap.dedent(f"""\
        import os, time
        from mpi4py import MPI
        open(f"{tmp_path}/pid.{{MPI.COMM_WORLD.rank}}", "w").write(str(os.getpid()))
        print("ready", flush=True)
        time.sleep({JOB_TIMEOUT_S})
    """))
    stderr = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "-np", "2", sys.executable, str(script)],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout is not None
        assert [proc.stdout.readline() for _ in range(2)] == ["ready\n", "ready\n"]
        sent = time.time()
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - sent < PROMPT_END_S
    assert returncode != 0
    stderr.seek(0)
    assert "psrun: job stopped by SIGINT" in stderr.read()
    for pid_file in tmp_path.glob("pid.*"):
        assert not _alive(int(pid_file.read_text())), f"rank process {pid_file.name} survived"


def _alive(pid: int, wait_s: float = 3.0) -> bool:
    """True if ``pid`` still runs after ``wait_s``; a zombie waiting to be reaped is dead."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.05)
    return True


def test_two_ranks_failing_at_once_show_one_traceback_and_name_a_log_of_the_rest(tmp_path: Path) -> None:
    """A shape mismatch raises on both ranks at once: psrun once printed both tracebacks line
    by line interleaved, with Open MPI's banners and a NUL byte, about 60 lines."""
    script = """\
        import torch
        import psrt.torch as hvd
        hvd.init()
        hvd.allreduce(torch.ones(2 + hvd.rank()), name="x")
    """
    done, _ = psrun("-np", "2", script=script, tmp_path=tmp_path, keep_log=True)
    lines = done.stderr.splitlines()
    assert done.returncode != 0, done.stderr
    assert lines[-1].startswith("psrun: rank ") and "raised CollectiveMismatchError: allreduce of tensor 'x'" \
        in lines[-1], done.stderr
    assert done.stderr.count("Traceback (most recent call last):") == 1, done.stderr
    assert "\x00" not in done.stderr and "MPI_ABORT" not in done.stderr and len(lines) < 30, done.stderr
    assert re.fullmatch(r"psrun: \d+ more lines of the job's stderr, not shown here, are in \S+\.log "
                        r"\(--verbose shows them all\)", lines[-2]), done.stderr
    log = take_log(done.stderr)
    assert log.count("Traceback (most recent call last):") == 2 and "MPI_ABORT" in log, log


def test_a_multiline_exception_message_reaches_the_summary_whole(tmp_path: Path) -> None:
    """The message of an optimizer's repr spans lines; the summary once ended at 'got AdamW ('."""
    script = """\
        import torch
        import psrt
        psrt.init()
        from mpi4py import MPI
        if MPI.COMM_WORLD.rank == 1:
            raise ValueError(f"got {torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.5)!r}")
        MPI.COMM_WORLD.barrier()
    """
    done, _ = psrun("-np", "2", script=script, tmp_path=tmp_path)
    summary = done.stderr.splitlines()[-1]
    assert summary.startswith("psrun: rank 1 failed first: raised ValueError: got AdamW ( Parameter Group 0 "), \
        done.stderr
    assert " lr: 0.5 " in summary and summary.endswith(")"), done.stderr


def test_sigkilled_psrun_leaves_no_mpirun_or_rank_running(tmp_path: Path) -> None:
    """mpirun has a session of its own; once, a psrun killed outright left it and every rank
    running with parent 1."""
    script = tmp_path / "sleepy.py"
    script.write_text(f"import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep({JOB_TIMEOUT_S})\n")
    job = start_job(psrun_argv("-np", "2", sys.executable, str(script)), "sleepy ranks")
    started: list[int] = []
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while len(re.findall(r"^pid \d+$", job.out, re.MULTILINE)) < 2 and time.monotonic() < deadline:
            assert job.proc.poll() is None, job.diagnosis()
            time.sleep(0.1)
        ranks = [int(pid) for pid in re.findall(r"^pid (\d+)$", job.out, re.MULTILINE)]
        assert len(ranks) == 2, job.diagnosis()
        started = [*_children(job.proc.pid), *ranks]  # mpirun, psrun's watcher, the ranks
        os.kill(job.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        job.proc.wait()
        while any(_running(pid) for pid in started) and time.monotonic() - killed_at < 30:
            time.sleep(0.1)
        took = time.monotonic() - killed_at
        print(f"mpirun and the ranks ended {took:.1f} s after psrun was killed")
        assert not [pid for pid in started if _running(pid)], f"still running {took:.0f} s after psrun was killed"
        assert took < 10, f"the job ended {took:.1f} s after psrun was killed"
    finally:
        for pid in started:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        job.finish(5)


def _children(pid: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return children


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
