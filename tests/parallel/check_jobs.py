"""Check-script jobs: launch one through psrun and read its report.

Each script of ``scripts/`` runs every check of one kind and prints one JSON line per check
on rank 0 (see ``scripts/_harness.py``); :class:`JobReport` holds what one job printed, and
asserts on a check or on the whole job.  job_server.py runs several scripts in one job and
reports each with the same class.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import pytest
from jobs import UNTUNED, take_log

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
JOB_TIMEOUT_S = 240.0
_TAIL = 3000


@dataclass
class JobReport:
    """What one job printed: a record per check, how it ended, and its output for diagnosis."""

    label: str
    returncode: int | None
    seconds: float
    records: dict[str, dict] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    done: int | None = None
    stdout: str = ""
    stderr: str = ""
    log: str = ""  # the log psrun wrote of a failed job's stderr
    ended_by: str = ""  # why a job server stopped inside this script, if it did

    @property
    def hung(self) -> str | None:
        """The check that hung, if the job ended on one."""
        return next((n for n in self.order if self.records[n].get("hung")), None)

    def why_incomplete(self) -> str:
        if self.ended_by:
            return self.ended_by
        if self.returncode is None:
            return f"the job was killed after {JOB_TIMEOUT_S:g} s"
        if self.hung is not None:
            return (f"the job ended when check {self.hung!r} hung: "
                    f"{self.records[self.hung]['detail']}")
        if self.done is None:
            return f"the job ended early with exit code {self.returncode}"
        if self.returncode != 0:
            return f"the job ran to its end but exited with code {self.returncode}"
        return "the script never ran it"

    def diagnosis(self) -> str:
        return (f"{self.label}: exit code {self.returncode} after {self.seconds:.1f} s\n"
                f"--- stdout (tail) ---\n{self.stdout[-_TAIL:]}\n"
                f"--- stderr (tail) ---\n{self.stderr[-_TAIL:]}"
                + (f"\n--- psrun's log (tail) ---\n{self.log[-_TAIL:]}" if self.log else ""))

    def assert_ok(self, name: str) -> dict:
        """Fail unless check ``name`` ran and passed on every rank; returns its record."""
        record = self.records.get(name)
        if record is None:
            # Without any report the job never got going: show its output.
            more = "" if self.records else "\n" + self.diagnosis()
            pytest.fail(f"check {name!r} did not report in {self.label}: "
                        f"{self.why_incomplete()}{more}", pytrace=False)
        assert record["ok"], f"{name} failed in {self.label}: {record['detail']}"
        return record

    def assert_complete(self, expected: Iterable[str]) -> None:
        """The job ended cleanly and reported exactly the ``expected`` checks, each once."""
        expected = set(expected)
        missing = sorted(expected - set(self.records))
        unexpected = sorted(set(self.records) - expected)
        repeated = sorted(n for n, times in Counter(self.order).items() if times > 1)
        problems = []
        if self.returncode != 0 or self.done is None:
            problems.append(f"job did not finish cleanly ({self.why_incomplete()})")
        if missing:
            problems.append(f"{len(missing)} checks never reported, e.g. {missing[:5]}")
        if unexpected:
            problems.append(f"unexpected checks {unexpected[:5]} (add tests for them)")
        if repeated:
            problems.append(f"checks reported twice: {repeated[:5]}")
        if self.done is not None and self.done != len(self.order):
            problems.append(f"script says it ran {self.done} checks, reported {len(self.order)}")
        assert not problems, "; ".join(problems) + "\n" + self.diagnosis()


def parse_report(report: JobReport, stdout: str) -> None:
    for line in stdout.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if "check" in record:
            report.order.append(record["check"])
            report.records[record["check"]] = record
        elif "done" in record:
            report.done = record["done"]


def start_psrun(script: str, np: int, env: Mapping[str, str] | None, args: tuple[str, ...] = (),
                psrun_args: tuple[str, ...] = (), stdin: int | None = None) -> subprocess.Popen[str]:
    """Start ``script`` on ``np`` ranks with psrun, its output piped."""
    command = [sys.executable, "-m", "launcher.cli", *psrun_args, "-np", str(np), sys.executable,
               str(SCRIPTS / script), *args]
    # Only the settings a job asks for: a PSRT_* or HOROVOD_* variable in the caller's
    # environment would silently change what every job tests.
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("PSRT_", "HOROVOD_"))}
    full_env.update(UNTUNED)
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    return subprocess.Popen(command, cwd=REPO, env=full_env, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)


def _psrun(script: str, np: int, env: Mapping[str, str] | None, args: tuple[str, ...], timeout_s: float,
           psrun_args: tuple[str, ...] = ()) -> tuple[int | None, str, str, float]:
    """Run ``script`` on ``np`` ranks with psrun; (exit code or None if killed, stdout, stderr,
    seconds)."""
    start = time.monotonic()
    proc = start_psrun(script, np, env, args, psrun_args)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        returncode: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        # psrun forwards SIGTERM to mpirun, which ends the ranks; then make sure.
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        returncode = None
    return returncode, stdout, stderr, time.monotonic() - start


def job_label(script: str, np: int, env: Mapping[str, str] | None, args: tuple[str, ...],
           psrun_args: tuple[str, ...] = ()) -> str:
    extra = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    return "`" + " ".join(filter(None, [extra, "psrun", *psrun_args, f"-np {np} {script}", *args])) + "`"


def launch(script: str, np: int, env: Mapping[str, str] | None = None,
           args: tuple[str, ...] = (), timeout_s: float = JOB_TIMEOUT_S,
           psrun_args: tuple[str, ...] = ()) -> JobReport:
    """Run ``script`` on ``np`` ranks with psrun (and its ``psrun_args``, e.g. ``--mpirun``)
    and parse its report (never raises on failure)."""
    returncode, stdout, stderr, seconds = _psrun(script, np, env, args, timeout_s, psrun_args)
    report = JobReport(label=job_label(script, np, env, args, psrun_args), returncode=returncode, seconds=seconds,
                       stdout=stdout, stderr=stderr, log=take_log(stderr))
    parse_report(report, stdout)
    return report
