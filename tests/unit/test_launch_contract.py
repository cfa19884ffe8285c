"""The contract between psrun and its ranks (``launcher/contract.py``): psrun reads what the
ranks write, in the names and lines both take from that one module, and psrun itself never
pays for torch or MPI."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher import contract
from launcher.failures import FailureKind, FailureScanner
from psrt.comm import stall_report
from psrt.config import _ENV_NAMES, config_from_env
from psrt.ps.roles import Roles

REPO = Path(__file__).resolve().parents[2]


def _parsed(*lines: str):
    scanner = FailureScanner()
    for line in lines:
        scanner.feed(line)
    return scanner.failure


def test_psrun_and_the_contract_import_neither_torch_nor_mpi4py():
    code = ("import sys, launcher.cli, launcher.contract; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'psrt') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_contract_loads_from_its_file_with_the_standard_library_alone():
    """As the ranks' start-up watcher (``python -I -S``) loads it."""
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('c', {str(REPO / 'launcher' / 'contract.py')!r}); "
            "c = importlib.util.module_from_spec(spec); spec.loader.exec_module(c); print(c.failure_line(1, 'x'))")
    done = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "psrt: rank 1 failed: x"


def test_a_failure_line_a_rank_prints_is_the_failure_psrun_reports():
    failure = _parsed(contract.failure_line(3, "raised ValueError: boom"))
    assert (failure.kind, failure.rank, failure.how) == (FailureKind.MARKER, 3, "raised ValueError: boom")


@pytest.mark.parametrize("role", [None, "worker 1", "parameter server 0"])
def test_a_blame_line_a_rank_prints_names_the_culprit_psrun_reports(role):
    line = contract.blame_line(0, contract.rank_name(2, role), "stopped answering while an allreduce waited 9 s")
    failure = _parsed(line, contract.failure_line(0, "stall: ..."))  # the reporter's own marker follows
    assert (failure.kind, failure.rank, failure.reporter, failure.role) == (FailureKind.BLAME, 2, 0, role)
    assert failure.how == "stopped answering while an allreduce waited 9 s"


def test_the_stall_reports_blame_lines_parse_as_blame_with_the_parameter_server_roles():
    roles = Roles(servers=(2,), workers=(0, 1, 3))
    for culprit, role in ((2, "parameter server 0"), (3, "worker 2")):
        line = stall_report.blame_line(1, [culprit], {}, "a pull", 61.0, roles.describe_rank)
        failure = _parsed(line)
        assert (failure.kind, failure.rank, failure.reporter, failure.role) == (FailureKind.BLAME, culprit, 1, role)


def test_the_settings_psrun_sets_are_the_ones_psrt_reads():
    config = config_from_env({contract.ENV_NUM_SERVERS: "2", contract.ENV_TIMELINE: "trace.json",
                              contract.ENV_TIMELINE_MARK_CYCLES: "1"})
    assert (config.num_servers, config.timeline, config.timeline_mark_cycles) == (2, "trace.json", True)


def test_psrun_forwards_every_variable_psrt_reads():
    unforwarded = [name for names in _ENV_NAMES.values() for name in names
                   if not name.startswith(contract.FORWARDED_PREFIXES)]
    assert not unforwarded, f"psrun does not pass these on to the ranks: {unforwarded}"
