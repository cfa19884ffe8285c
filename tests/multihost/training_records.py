"""Reading what ``cross_host_job.py`` printed, and comparing a job's training with the same
job on one host (shared by the multi-host and the SLURM tests, which compare against the
same one-host runs: each is made once per test session)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from jobs import psrun_argv, start_job

JOB = str(Path(__file__).resolve().parent / "cross_host_job.py")
_ONE_HOST: dict[tuple, dict] = {}
_TIMEOUT_S = 180.0


def records(output: str) -> dict[tuple[str, int], dict]:
    """The JSON lines in a job's ``output``, by (part, rank)."""
    found = {}
    for line in output.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            found[record["part"], record["rank"]] = record
    return found


def results(job, code: int | None) -> dict[tuple[str, int], dict]:
    """The JSON lines a job printed, by (part, rank); fails the test unless the job succeeded."""
    assert code == 0, job.diagnosis()
    return records(job.out)


def assert_same_training(two_hosts: dict, one_host: dict, part: str, ranks: int) -> None:
    for rank in range(ranks):
        got, want = two_hosts.get((part, rank)), one_host.get((part, rank))
        assert got is not None and want is not None, f"{part}: rank {rank} reported nothing"
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-5, abs=1e-7), \
            f"{part}: losses of rank {rank} on two hosts {got['losses']} vs one host {want['losses']}"
        assert len(got["params"]) == len(want["params"]) > 0
        assert got["params"] == pytest.approx(want["params"], rel=1e-4, abs=1e-6), \
            f"{part}: parameters of rank {rank} differ between two hosts and one host"


def torchrun_places(hosts: list[str]) -> list[dict[str, str]]:
    """torchrun's variables of ranks 0, 1, ... that ran on ``hosts`` (in rank order): the node is
    the host, numbered in the order of their lowest ranks."""
    nodes = list(dict.fromkeys(hosts))
    return [{"RANK": str(rank), "WORLD_SIZE": str(len(hosts)), "LOCAL_RANK": str(hosts[:rank].count(host)),
             "LOCAL_WORLD_SIZE": str(hosts.count(host)), "GROUP_RANK": str(nodes.index(host)),
             "GROUP_WORLD_SIZE": str(len(nodes))} for rank, host in enumerate(hosts)]


def assert_torchrun_places(found: dict, part: str, ranks: int, at_import: tuple[str, ...]) -> None:
    """Each rank's torchrun variables after init() say where it ran; before it (as psrun's wrapper
    or ``import psrt.torch`` set them), the ``at_import`` ones had the same values, the rest none."""
    hosts = [found[part, rank]["host"] for rank in range(ranks)]
    for rank, place in enumerate(torchrun_places(hosts)):
        record = found[part, rank]
        assert record["torch"] == place, f"{part}: rank {rank} on {hosts}: {record['torch']} != {place}"
        before = {name: place[name] if name in at_import else None for name in place}
        assert record["torch_at_import"] == before, f"{part}: rank {rank}: {record['torch_at_import']} before init()"


def one_host(psrun_args: tuple[str, ...], parts: tuple[str, ...]) -> dict:
    """What ``psrun PSRUN_ARGS python cross_host_job.py PARTS`` printed on this machine
    alone, run once per session."""
    key = (psrun_args, parts)
    if key not in _ONE_HOST:
        argv = psrun_argv(*psrun_args, sys.executable, JOB, *parts)
        job = start_job(argv, f"one-host `psrun {' '.join(psrun_args + parts)}`", {"PSRT_STALL_CHECK_TIME": "60"})
        _ONE_HOST[key] = results(job, job.finish(_TIMEOUT_S))
    return _ONE_HOST[key]
