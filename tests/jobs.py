"""Jobs started in the background through psrun, for tests and benchmarks that act while a
job runs (freeze a rank, cut a link) or time how it ends; on ``sys.path`` through
setup.cfg's ``pythonpath = tests``, and by the benchmarks' own path set-up."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Test jobs keep the fixed algorithm thresholds: with tuning, which algorithm a test
#: exercises at a size would depend on timings of the moment (a fresh clone measures at its
#: first job), and the tests would write the user's cache.  tests/parallel/test_tuning_job.py
#: tests tuning itself.
UNTUNED = {"PSRT_TUNE": "off"}


@dataclass
class Job:
    """A psrun job running in the background; output is collected line by line, with arrival times."""

    proc: subprocess.Popen[str]
    label: str
    stdout: list[tuple[float, str]] = field(default_factory=list)
    stderr: list[tuple[float, str]] = field(default_factory=list)
    ended_at: float | None = None
    log: str = ""  # the log psrun wrote of a failed job's stderr (see take_log)
    _readers: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        for stream, lines in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            reader = threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            reader.start()
            self._readers.append(reader)

    @staticmethod
    def _read(stream: object, lines: list[tuple[float, str]]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.append((time.time(), line.rstrip("\n")))

    @property
    def out(self) -> str:
        return "\n".join(line for _, line in list(self.stdout))

    @property
    def err(self) -> str:
        return "\n".join(line for _, line in list(self.stderr))

    def wait_for_line(self, pattern: str, timeout_s: float) -> float:
        """Wait until stdout has a line matching ``pattern``; returns when it arrived."""
        deadline = time.monotonic() + timeout_s
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            for arrived, line in list(self.stdout):
                if regex.search(line):
                    return arrived
            if self.proc.poll() is not None and not any(r.is_alive() for r in self._readers):
                break
            time.sleep(0.05)
        raise TimeoutError(f"{self.label}: no line matching {pattern!r} within {timeout_s:g} s\n{self.diagnosis()}")

    def finish(self, timeout_s: float) -> int | None:
        """Wait for the job to end; returns psrun's exit code, or None if it had to be killed."""
        try:
            code: int | None = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        self.ended_at = self.ended_at or time.time()
        for reader in self._readers:
            reader.join(timeout=5)
        self.log = take_log(self.err)
        return code

    def stop(self) -> None:
        """End the job: SIGTERM to psrun (which passes it to mpirun), then SIGKILL to its group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def diagnosis(self) -> str:
        return (f"{self.label}: exit code {self.proc.poll()}\n--- stdout (tail) ---\n{self.out[-3000:]}\n"
                f"--- stderr (tail) ---\n{self.err[-3000:]}" + (f"\n--- psrun's log (tail) ---\n{self.log[-3000:]}"
                                                                if self.log else ""))


_LOG_LINE = re.compile(r"^psrun: \d+ more lines? of the job's stderr, not shown here, (?:are|is) in (\S+) ", re.MULTILINE)


def take_log(stderr: str) -> str:
    """The text of the log file a failed job's psrun named in ``stderr``, removed so that tests
    leave no files behind; "" if it named none."""
    found = _LOG_LINE.search(stderr)
    if found is None:
        return ""
    path = Path(found.group(1))
    try:
        text = path.read_text(errors="replace")
        path.unlink()
    except OSError:
        return ""
    return text


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment without PSRT_/HOROVOD_ settings (they would change what a job tests), plus
    the repository on PYTHONPATH and ``extra``; tuning off unless ``extra`` asks for it (see
    :data:`UNTUNED`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSRT_", "HOROVOD_"))}
    env.update(UNTUNED)
    env.update(extra or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def start_job(argv: Sequence[str], label: str, env: Mapping[str, str] | None = None) -> Job:
    proc = subprocess.Popen(list(argv), cwd=REPO, env=job_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    return Job(proc, label)


def psrun_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher.cli", *args]
