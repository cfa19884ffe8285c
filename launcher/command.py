"""Turn what the user asked for into an mpirun command line.

The work is split in two pure steps so that both can be tested without MPI:
:func:`plan_launch` checks the request against the hosts and decides every
policy question (rank count, oversubscription, local-only tuning) into a
:class:`LaunchPlan`; :func:`build_command` spells that plan in the dialect of
one MPI flavour. Finding and identifying the mpirun executable
(:mod:`launcher.mpi`) is the only part that touches the system; the options
for reaching other hosts are checked in :mod:`launcher.remote`.

Two policies matter beyond one machine. A job on this machine only needs no
network between ranks, so Open MPI is held to shared memory (no rank opens a
TCP listener), and each rank's stderr goes to psrun on a pipe of its own
(:mod:`launcher.rank_stderr`). A job across hosts may need to be told how to
reach them: a launch agent (what Open MPI calls ``plm_rsh_agent``, Hydra
``-launcher-exec``) and the networks to use, by interface name or, where names
differ between hosts, by CIDR.

Requests that cannot work stop here, before anything starts: a host name that
resolves to no address, a program that is not there (on this machine), a Python
script given as the program, and more ranks than a few per slot on this machine
(``-np 100000`` would fork that many processes) unless ``--oversubscribe`` asks
for it.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from launcher.addresses import is_local_host, unknown_hosts
from launcher.contract import FORWARDED_PREFIXES
from launcher.hostfile import Host, total_slots
from launcher.mpi import (LaunchError, MpiFlavour, detect_flavour, detect_mpi, find_mpirun,
                          flavour_from_version, user_sets_mca, version_from_text)
from launcher.rank_stderr import wrap_command
from launcher.remote import checked_launch_agent, checked_networks

__all__ = [
    "IMPLICIT_OVERSUBSCRIBE",
    "check_implicit_oversubscription",
    "LaunchError",
    "LaunchPlan",
    "MpiFlavour",
    "build_command",
    "detect_flavour",
    "detect_mpi",
    "find_mpirun",
    "flavour_from_version",
    "forwarded_names",
    "plan_launch",
    "rank_hosts",
    "version_from_text",
]

# Ranks on other machines start from a bare ssh environment; give them ours.
_REMOTE_ONLY_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
# Open MPI spends about a second probing its OFI transport at start-up. On one
# machine it never wins over shared memory, so local jobs exclude it.
_LOCAL_OMPI_MTL = ("mtl", "^ofi")
# On one machine ranks need only shared memory and self; without this every rank's
# TCP transport listens on all addresses (0.0.0.0 and ::) for the whole job.
# Open MPI 5 renamed the shared-memory BTL from "vader" to "sm".
_LOCAL_BTL_OMPI5 = "self,sm"
_LOCAL_BTL_OMPI4 = "self,vader"
# MPICH's ranks listen for each other through UCX's TCP transport (its default netmod) or
# libfabric's tcp/sockets providers (the ofi netmod) on every interface of the host. These
# variables hold them to one interface: loopback for a job on this machine alone (ranks talk
# through shared memory anyway), else the one -iface names. Intel MPI's ranks open none.
_MPICH_RANK_INTERFACE = ("UCX_NET_DEVICES", "FI_TCP_IFACE", "FI_SOCKETS_IFACE")
# Across hosts a rank that dies closes its TCP connections, and a peer that notices first
# aborts ("Socket closed"), often before the dead rank's own daemon reports it: the job
# would be blamed on the peer. A short delay before an abort lets the real cause arrive.
_REMOTE_ABORT_DELAY = ("mpi_abort_delay", "1")
# Ranks per slot of this machine that psrun oversubscribes to by itself (with a warning);
# beyond it only --oversubscribe does. Tests run 4 ranks on 2 cores.
IMPLICIT_OVERSUBSCRIBE = 4


def check_implicit_oversubscription(num_proc: int, slots: int, where: str, flag: str = "-np") -> None:
    """Refuse more than :data:`IMPLICIT_OVERSUBSCRIBE` ranks per slot on this machine unless
    ``--oversubscribe`` is given (the caller checks that): ``-np 100000`` is a typo."""
    if num_proc > IMPLICIT_OVERSUBSCRIBE * slots:
        raise LaunchError(f"{flag} {num_proc} is more than {IMPLICIT_OVERSUBSCRIBE} ranks for each of the {where}; "
                          "ask for fewer, or add --oversubscribe to start that many processes on this machine anyway")
# mpirun arguments that choose how ranks' output is shown or where it goes; psrun then
# leaves the ranks' stderr to mpirun rather than reading it on pipes of its own.
_OUTPUT_FLAGS = frozenset({
    "--output", "-output", "--tag-output", "-tag-output", "--timestamp-output", "-timestamp-output",
    "--xml", "-xml", "--output-filename", "-output-filename", "--merge-stderr-to-stdout",
    "-merge-stderr-to-stdout", "-prepend-rank", "-l", "-prepend-pattern", "-outfile-pattern", "-errfile-pattern",
})


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to write the mpirun command line, already validated.

    ``hosts`` is empty when the MPI's own default (this machine) is wanted.
    ``rank_stderr``: each rank's stderr goes to psrun on a pipe of its own
    (through the wrapper ``command`` is written out in on every host, which also sets
    torchrun's variables). ``rank_env`` holds the
    variables psrun's own flags set on every rank; they win over the same names
    in psrun's environment. ``launch_agent`` is the
    command that starts the MPI's daemon on a remote host (``AGENT host
    command...``, as ssh is called); ``networks`` are interface names and
    normalised IPv4 CIDRs, in the order given. ``version`` is the MPI's own
    version, () when unknown.
    """

    flavour: MpiFlavour
    mpirun: str
    num_proc: int
    hosts: tuple[Host, ...]
    local_only: bool
    oversubscribe: bool
    as_root: bool
    command: tuple[str, ...]
    mpi_args: tuple[str, ...] = ()
    rank_env: tuple[tuple[str, str], ...] = ()
    launch_agent: str | None = None
    networks: tuple[str, ...] = ()
    version: tuple[int, ...] = ()
    rank_stderr: bool = False


def plan_launch(
    *,
    flavour: MpiFlavour,
    mpirun: str,
    command: Sequence[str],
    num_proc: int | None,
    hosts: tuple[Host, ...] | None,
    local_cpus: int,
    oversubscribe: bool = False,
    as_root: bool = False,
    mpi_args: Sequence[str] = (),
    rank_env: Sequence[tuple[str, str]] = (),
    launch_agent: str | None = None,
    network_interfaces: Sequence[str] = (),
    network_cidrs: Sequence[str] = (),
    version: Sequence[int] = (),
) -> tuple[LaunchPlan, list[str]]:
    """Check a request and decide its policies; returns the plan and warnings for stderr.

    ``hosts`` is None when the user gave none (a job on this machine with
    ``local_cpus`` slots). Without ``oversubscribe``, asking for more ranks
    than slots is an error when remote hosts are involved, and a warning
    (plus ``--oversubscribe``) when the job stays on this machine, up to
    :data:`IMPLICIT_OVERSUBSCRIBE` ranks per slot (an error beyond).
    ``launch_agent`` and the networks only concern remote hosts: a job on this
    machine alone ignores them, with a warning, so that one command line can
    serve both kinds of job.
    """
    if not command:
        raise LaunchError("no command given; usage: psrun -np N [options] command ...")
    launch_agent = checked_launch_agent(launch_agent, flavour, mpi_args)
    networks = checked_networks(network_interfaces, network_cidrs, flavour, mpi_args)
    # With a launch agent of the user's (an ssh config alias, kubectl exec) a name psrun cannot
    # resolve may still be reachable: the agent decides.
    unknown = [] if launch_agent else unknown_hosts(h.name for h in hosts or ())
    if unknown:
        raise LaunchError(f"unknown host{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: "
                          "no address found for it; check the spelling (hosts that are this machine can be "
                          "written localhost)")
    local_only = hosts is None or all(is_local_host(h.name) for h in hosts)
    command = _checked_program(command, local_only)
    slots = local_cpus if hosts is None else total_slots(hosts)
    where = f"{local_cpus} local CPUs" if hosts is None else f"{slots} slots on {_host_list(hosts)}"
    if num_proc is None:
        num_proc = slots
    if num_proc <= 0:
        raise LaunchError(f"-np {num_proc}: the number of ranks must be a positive integer")
    warnings = []
    if num_proc > slots and not oversubscribe:
        if not local_only:
            raise LaunchError(
                f"-np {num_proc} asks for more ranks than the {where}; "
                "ask for fewer or add --oversubscribe"
            )
        check_implicit_oversubscription(num_proc, slots, where)
        warnings.append(f"psrun: warning: {num_proc} ranks on {where}; adding --oversubscribe "
                        "(ranks share CPUs and run slower)")
        oversubscribe = True
    if local_only:
        unused = [flag for flag, given in (("--launch-agent", launch_agent is not None),
                                           ("--network-interface", bool(network_interfaces)),
                                           ("--network-cidr", bool(network_cidrs))) if given]
        if unused:
            warnings.append(f"psrun: warning: every host is this machine, so {' and '.join(unused)} "
                            "not used (ranks on one machine talk through shared memory)")
        launch_agent, networks = None, ()
    if hosts is None and flavour is MpiFlavour.OPENMPI:
        # Open MPI counts physical cores by default; make it use the count psrun checked.
        hosts = (Host("localhost", local_cpus),)
    plan = LaunchPlan(
        flavour=flavour, mpirun=mpirun, num_proc=num_proc, hosts=hosts or (),
        local_only=local_only, oversubscribe=oversubscribe, as_root=as_root,
        command=tuple(command), mpi_args=tuple(mpi_args), rank_env=tuple(rank_env),
        launch_agent=launch_agent, networks=networks, version=tuple(version),
        rank_stderr=local_only and not any(arg.split("=", 1)[0] in _OUTPUT_FLAGS for arg in mpi_args),
    )
    return plan, warnings


def rank_hosts(plan: LaunchPlan) -> tuple[str, ...]:
    """The host of each rank as the MPIs place ranks by default, filling each host's slots in
    order; () where that is not known (no hosts given to the MPI, or more ranks than slots)."""
    names = [host.name for host in plan.hosts for _ in range(host.slots)]
    return tuple(names[:plan.num_proc]) if plan.hosts and plan.num_proc <= len(names) else ()


def _checked_program(command: Sequence[str], local_only: bool) -> Sequence[str]:
    """``command``, once its program is known to be runnable, the way mpirun looks for it.

    A Python script given as the program is refused with the fix (it runs only if executable
    with a ``#!`` line, which ``psrun -np 2 train.py`` seldom means). On this machine a
    program is looked for on PATH, then in the working directory (as Open MPI does): one not
    found is refused, and one found only in the working directory is named by its path.
    Programs on other hosts are theirs to find.
    """
    program = command[0]
    runnable = _is_executable_file(program) if os.sep in program else (
        shutil.which(program) is not None or _is_executable_file(program))
    if program.endswith(".py") and not runnable:
        raise LaunchError(f"{program!r} is a Python script, not a program: run it with Python, "
                          f"e.g. psrun ... python {program}")
    if not local_only:
        return command
    if not runnable:
        raise LaunchError(f"program {program!r} not found: not on PATH, nor in {os.getcwd()}")
    if os.sep not in program and shutil.which(program) is None:
        return [os.path.abspath(program), *command[1:]]
    return command


def _is_executable_file(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _host_list(hosts: Sequence[Host]) -> str:
    return ",".join(str(h) for h in hosts)


def forwarded_names(env: Mapping[str, str], *, local_only: bool,
                    overridden: Collection[str] = ()) -> list[str]:
    """Names of the environment variables every rank must receive from ``env`` (less the
    ``overridden`` ones, which psrun sets itself)."""
    names = sorted(n for n in env if n.startswith(FORWARDED_PREFIXES) and n not in overridden)
    if not local_only:
        names += [n for n in _REMOTE_ONLY_NAMES if n in env]
    return names


def _forwarded(plan: LaunchPlan, env: Mapping[str, str]) -> list[str]:
    return forwarded_names(env, local_only=plan.local_only,
                           overridden={name for name, _ in plan.rank_env})


def _openmpi_options(plan: LaunchPlan, env: Mapping[str, str]) -> list[str]:
    options = ["-np", str(plan.num_proc)]
    if plan.hosts:
        options += ["-H", _host_list(plan.hosts)]
    # psrt ranks run helper threads; pinning each rank to one core starves them.
    options += ["--bind-to", "none"]
    if plan.as_root:
        options.append("--allow-run-as-root")
    if plan.oversubscribe:
        options.append("--oversubscribe")
    if plan.local_only:
        local_btl = _LOCAL_BTL_OMPI4 if plan.version and plan.version[0] < 5 else _LOCAL_BTL_OMPI5
        for name, value in (("btl", local_btl), _LOCAL_OMPI_MTL):
            if not user_sets_mca(name, env, plan.mpi_args):
                options += ["--mca", name, value]
    elif not user_sets_mca(_REMOTE_ABORT_DELAY[0], env, plan.mpi_args):
        options += ["--mca", *_REMOTE_ABORT_DELAY]
    if plan.launch_agent is not None:
        # Open MPI 5 ignores OMPI_MCA_plm_rsh_agent in the environment, but on the
        # command line mpirun hands this name to PRTE (as plm_ssh_agent); 4.x reads it as is.
        options += ["--mca", "plm_rsh_agent", plan.launch_agent]
    if plan.networks:
        # MPI traffic (btl) and the runtime's own (oob) must both find the network.
        networks = ",".join(plan.networks)
        options += ["--mca", "btl_tcp_if_include", networks, "--mca", "oob_tcp_if_include", networks]
    for name in _forwarded(plan, env):
        options += ["-x", name]
    for name, value in plan.rank_env:
        options += ["-x", f"{name}={value}"]
    return options


def _mpich_options(plan: LaunchPlan, env: Mapping[str, str]) -> list[str]:
    options = ["-n", str(plan.num_proc)]
    if plan.hosts:
        options += ["-hosts", _host_list(plan.hosts)]
    if plan.launch_agent is not None:
        # Hydra calls the agent like ssh: AGENT [ssh options such as -x] HOST COMMAND...
        options += ["-launcher", "ssh", "-launcher-exec", plan.launch_agent]
    if plan.networks:
        options += ["-iface", plan.networks[0]]
    for name in _forwarded(plan, env):
        options += ["-genv", name, env[name]]
    for name, value in plan.rank_env:
        options += ["-genv", name, value]
    interface = "lo" if plan.local_only else plan.networks[0] if plan.networks else None
    if plan.flavour is MpiFlavour.MPICH and interface is not None:
        options += [arg for name in _MPICH_RANK_INTERFACE if name not in env
                    and name not in plan.mpi_args for arg in ("-genv", name, interface)]
    return options


def build_command(plan: LaunchPlan, env: Mapping[str, str]) -> list[str]:
    """The full mpirun command line for ``plan``; ``env`` is the environment it will run in."""
    if plan.flavour is MpiFlavour.OPENMPI:
        options = _openmpi_options(plan, env)
    else:
        options = _mpich_options(plan, env)
    return [plan.mpirun, *options, *plan.mpi_args, *wrap_command(plan.command)]
