"""torchrun's variables for every rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``): psrun's rank wrapper (a real ``/bin/sh`` running it) and
``import psrt.torch`` take them from the same launcher variables and give the same values; ``init()``
fills the rest from the runtime's groups; none is ever replaced, and none is set in
parameter-server mode before ``init()`` or in a process no launcher started.  Under real launchers:
tests/parallel/scripts/torch_backend_check.py, tests/multihost and tests/cluster."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest

from launcher.contract import TORCH_VARIABLE_NAMES
from launcher.rank_stderr import wrap_command
from psrt.rank_env import export_rank_variables, launcher_variables

OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
HYDRA = {"PMI_RANK": "3", "MPI_LOCALRANKID": "1", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"}
RANK_3_OF_2_X_2 = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
# What a rank that mpirun started inside a SLURM allocation inherits from the batch script (task 0)
BATCH_SCRIPT = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "7"}


def wrapper_sets(env: dict[str, str]) -> dict[str, str]:
    """torchrun's variables of a program that psrun's rank wrapper started with ``env``."""
    done = subprocess.run(wrap_command(["/usr/bin/env"]), env=env, capture_output=True, text=True, check=True,
                          timeout=30)
    started = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return {name: started[name] for name in TORCH_VARIABLE_NAMES if name in started}


def imported_sets(env: dict[str, str]) -> dict[str, str]:
    """torchrun's variables of a process with ``env`` once it has imported psrt.torch."""
    after = {**env, **launcher_variables(env)}
    return {name: after[name] for name in TORCH_VARIABLE_NAMES if name in after}


@pytest.mark.parametrize("launcher", [OPEN_MPI, HYDRA, {**OPEN_MPI, **BATCH_SCRIPT}, {**HYDRA, **BATCH_SCRIPT}],
                         ids=["open-mpi", "hydra", "open-mpi-in-slurm-batch", "hydra-in-slurm-batch"])
def test_psrun_and_the_import_give_torchruns_variables_from_the_launchers(launcher):
    assert wrapper_sets(launcher) == RANK_3_OF_2_X_2
    assert imported_sets(launcher) == RANK_3_OF_2_X_2


def test_a_value_the_rank_has_stays_and_an_empty_one_counts_as_missing():
    env = {**OPEN_MPI, "LOCAL_RANK": "0", "RANK": ""}
    assert wrapper_sets(env) == imported_sets(env) == {**RANK_3_OF_2_X_2, "LOCAL_RANK": "0"}


def test_ranks_srun_starts_take_slurms_and_the_rest_waits_for_init():
    srun_pmix = {"PMIX_RANK": "2", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
    assert imported_sets(srun_pmix) == {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}
    srun_pmi2 = {"PMI_RANK": "2", "PMI_SIZE": "4", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4"}
    assert imported_sets(srun_pmi2) == {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4"}


@pytest.mark.parametrize("env", [{**OPEN_MPI, "PSRT_NUM_SERVERS": "1"}, {**HYDRA, "PSRT_NUM_SERVERS": "2"},
                                 {}, BATCH_SCRIPT],
                         ids=["parameter-servers-open-mpi", "parameter-servers-hydra", "no-launcher",
                              "slurm-batch-script-alone"])
def test_none_before_init_in_parameter_server_mode_nor_in_a_process_no_launcher_started(env):
    assert wrapper_sets(env) == {}
    assert imported_sets(env) == {}
    assert wrapper_sets({**env, "PSRT_NUM_SERVERS": "0"}) == imported_sets({**env, "PSRT_NUM_SERVERS": "0"})


def _topology(rank: int, size: int, local: tuple[int, int], cross: tuple[int, int], host: tuple[int, int]):
    def group(rank: int, size: int) -> SimpleNamespace:
        return SimpleNamespace(rank=rank, size=size)

    return SimpleNamespace(world=group(rank, size), local=group(*local), cross=group(*cross),
                           host_place=lambda: host)


def test_init_fills_what_is_missing_from_the_runtimes_groups_and_keeps_the_rest():
    """Worker 1 of a parameter-server job: alone on the second of two hosts, its RANK is its index
    among the 2 workers; a LOCAL_RANK given by the user stays.  HOROVOD_* are replaced."""
    env = {**OPEN_MPI, "PSRT_NUM_SERVERS": "1", "LOCAL_RANK": "5", "HOROVOD_RANK": "9"}
    export_rank_variables(_topology(1, 2, local=(0, 1), cross=(1, 2), host=(1, 2)), env)
    assert {name: env[name] for name in TORCH_VARIABLE_NAMES} == {
        "RANK": "1", "LOCAL_RANK": "5", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2"}
    assert (env["HOROVOD_RANK"], env["HOROVOD_LOCAL_SIZE"], env["HOROVOD_CROSS_RANK"]) == ("1", "1", "1")


def test_init_sets_no_torchrun_variable_in_a_process_no_launcher_started():
    env: dict[str, str] = {}
    export_rank_variables(_topology(0, 1, local=(0, 1), cross=(0, 1), host=(0, 1)), env)
    assert env["HOROVOD_SIZE"] == "1" and not set(TORCH_VARIABLE_NAMES) & set(env)
