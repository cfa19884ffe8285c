"""Check-script jobs run once each, most of them inside long-lived job servers.

Starting Python and importing torch on every rank costs seconds per job, more than many
scripts' checks take.  :class:`CheckJobs` keeps one job server (``scripts/_job_server.py``)
per rank count and hands it each script whose settings it can give a script in-process; the
server runs it in a fresh psrt runtime and the report reads as that of a job of its own.
Scripts whose settings outlive them (parameter servers, module flags) still get jobs of
their own, as does a script a server could not begin.  The next script is handed over only
when a test asks for it, so a server never runs beside another test's job.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

from check_jobs import JOB_TIMEOUT_S, JobReport, job_label, launch, parse_report, start_psrun
from jobs import take_log

#: Settings a job server can give a script: only ``psrt.init()`` reads them (scripts/_harness.py
#: reads ``CHECKS_MATCHING``).  ``PSRT_NUM_SERVERS`` cannot be: parameter servers exit their
#: process at shutdown.
SERVER_SETTINGS = {"PSRT_FUSION_THRESHOLD", "PSRT_RING_THRESHOLD", "PSRT_RING_SEGMENT",
                   "PSRT_HIERARCHICAL_ALLREDUCE", "PSRT_TP_CHECK_SHAPES", "CHECKS_MATCHING"}
#: Arguments whose effect would outlive the script: engine_check.py's
#: ``--without-persistent-collectives`` changes a psrt module flag for the rest of the process.
#: (Other arguments choose checks, or where a script writes.)
UNSHAREABLE_ARGS = {"--without-persistent-collectives"}
SCRIPT_TIMEOUT_S = 240.0  # as scripts/_job_server.py's SCRIPT_TIMEOUT_S; the first script waits for start-up too
_QUIT_TIMEOUT_S = 30.0


class JobServer:
    """One running ``_job_server.py`` job on ``np`` ranks; scripts are handed to it one at a time."""

    def __init__(self, np: int, psrun_args: tuple[str, ...] = ()) -> None:
        self.np, self.psrun_args = np, psrun_args
        self._proc = start_psrun("_job_server.py", np, {"JOB_SERVER_OWNER": str(os.getpid())}, psrun_args=psrun_args,
                                 stdin=subprocess.PIPE)
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._changed = threading.Condition()
        self._entries = 0
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self._proc.stdout, self._stdout), (self._proc.stderr, self._stderr))]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: object, lines: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._changed:
                lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def run(self, script: str, env: Mapping[str, str], args: tuple[str, ...]) -> JobReport | None:
        """Run ``script`` in this job and report it; None if the job had ended before it began
        (the script is then best run alone).  A job that ends inside the script is done."""
        entry, self._entries = self._entries, self._entries + 1
        out_from, err_from = len(self._stdout), len(self._stderr)
        start = time.monotonic()
        order = {"entry": entry, "script": script, "args": list(args), "env": dict(env)}
        try:
            self._proc.stdin.write(json.dumps(order) + "\n")  # type: ignore[union-attr]
            self._proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:
            return None
        limit = SCRIPT_TIMEOUT_S + (JOB_TIMEOUT_S if entry == 0 else 0.0) + 15.0
        end = self._wait_for(entry, out_from, start + limit)
        if end is None:
            timed_out = self.alive
            self.stop()
            for reader in self._readers:
                reader.join(timeout=5)
            if not any(_marker(line, "begin", entry) for line in self._stdout[out_from:]):
                return None
        lines = [line for line in self._stdout[out_from:] if not _marker(line, None, entry)]
        stderr = "\n".join(self._stderr[err_from:])
        label = (job_label(script, self.np, env, args, self.psrun_args)
                 + f" (script {entry + 1} of the job server `psrun -np {self.np} scripts/_job_server.py`)")
        report = JobReport(label=label, returncode=0 if end else self._proc.returncode,
                           seconds=end["seconds"] if end else time.monotonic() - start,
                           stdout="\n".join(lines), stderr=stderr, log=take_log(stderr))
        parse_report(report, report.stdout)
        if end is None:
            report.ended_by = self._why_ended(entry, limit if timed_out else None)
        return report

    def _wait_for(self, entry: int, out_from: int, deadline: float) -> dict | None:
        """The end marker of ``entry``, or None once the job ended or ``deadline`` passed."""
        with self._changed:
            while True:
                for line in self._stdout[out_from:]:
                    marker = _marker(line, "end", entry)
                    if marker is not None:
                        return marker
                if not self.alive and not any(reader.is_alive() for reader in self._readers):
                    return None
                if time.monotonic() > deadline:
                    return None
                self._changed.wait(timeout=1.0)

    def _why_ended(self, entry: int, stopped_after_s: float | None) -> str:
        """What ended the job inside ``entry``; "" if the harness's own records tell (a hung check)."""
        for line in self._stdout:
            marker = _marker(line, None, entry)
            if marker is not None and marker["job_server"] in ("failed", "timeout"):
                return f"the job server ended inside it: {marker['detail']}"
        if stopped_after_s is not None:
            return f"the job server was stopped: the script had not finished within {stopped_after_s:g} s"
        return ""

    def stop(self) -> None:
        """End the job: SIGTERM to psrun (which passes it to mpirun), then SIGKILL to its group."""
        if self.alive:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()

    def close(self) -> None:
        """Let the job end by itself, or stop it."""
        try:
            self._proc.stdin.write('"quit"\n')  # type: ignore[union-attr]
            self._proc.stdin.close()  # type: ignore[union-attr]
            self._proc.wait(timeout=_QUIT_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            self.stop()


def _marker(line: str, kind: str | None, entry: int) -> dict | None:
    """The job server's marker of ``kind`` (any, if None) for ``entry`` on ``line``, if any."""
    start = line.find('{"job_server"')
    if start < 0:
        return None
    try:
        marker = json.loads(line[start:])
    except json.JSONDecodeError:
        return None
    if marker.get("entry") != entry or (kind is not None and marker["job_server"] != kind):
        return None
    return marker


class CheckJobs:
    """Each distinct job runs once, on first use: inside the job server of its rank count
    when it can (see :data:`SERVER_SETTINGS`, :data:`UNSHAREABLE_ARGS`), else in a job of its own."""

    def __init__(self, psrun_args: tuple[str, ...] = ()) -> None:
        self.psrun_args = psrun_args
        self._reports: dict[tuple, JobReport] = {}
        self._servers: dict[int, JobServer] = {}

    def get(self, script: str, np: int, env: Mapping[str, str] | None = None,
            args: tuple[str, ...] = ()) -> JobReport:
        env = dict(env or {})
        key = (script, np, tuple(sorted(env.items())), tuple(args))
        if key not in self._reports:
            report = self._in_server(script, np, env, tuple(args)) if self._shareable(env, args) else None
            self._reports[key] = report or launch(script, np, env, args, psrun_args=self.psrun_args)
        return self._reports[key]

    @staticmethod
    def _shareable(env: Mapping[str, str], args: tuple[str, ...]) -> bool:
        return set(env) <= SERVER_SETTINGS and not UNSHAREABLE_ARGS.intersection(args)

    def _in_server(self, script: str, np: int, env: Mapping[str, str], args: tuple[str, ...]) -> JobReport | None:
        server = self._servers.get(np)
        if server is None or not server.alive:
            server = self._servers[np] = JobServer(np, self.psrun_args)
        return server.run(script, env, args)

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        self._servers.clear()
