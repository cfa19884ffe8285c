"""psrun: launch psrt jobs with mpirun on one machine, a host list or a SLURM allocation.

``psrun -np 4 python train.py`` finds mpirun, checks the hosts, writes the
mpirun command line for Open MPI or MPICH, runs it and names the rank that
failed first, or the one a stall report blames. See ``psrun --help`` and ``hostfile.example``.
"""
from __future__ import annotations

from launcher.command import (
    LaunchError,
    LaunchPlan,
    MpiFlavour,
    build_command,
    plan_launch,
)
from launcher.hostfile import Host, HostfileError, parse_hostfile, parse_hosts

__all__ = [
    "Host",
    "HostfileError",
    "LaunchError",
    "LaunchPlan",
    "MpiFlavour",
    "build_command",
    "parse_hostfile",
    "parse_hosts",
    "plan_launch",
]
