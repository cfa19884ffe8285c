"""Run the mpirun command, pass its output through live, and watch for failures.

stdout is copied chunk by chunk, untouched. stderr, where failures show, goes through a
:class:`~launcher.stderr_filter.StderrFilter`, which feeds every line to the
:class:`~launcher.failures.FailureScanner` and, once the job fails, shows the failing rank's
traceback once and writes the rest to a log. For a job on this machine alone each rank's
stderr comes on a pipe of its own (:mod:`launcher.rank_stderr`), else from mpirun merged;
one thread reads every stderr source.

mpirun runs in its own session so that a Ctrl-C reaches it once, through psrun, rather than
twice (a second SIGINT makes Open MPI kill the job without cleaning up), and so that once a
failed job is over, any process of it still on this host (a rank that was stopped, which
ignores the SIGTERM Open MPI sends it) is found and killed. A watcher process
(:mod:`launcher.lifeline`) ends the job should psrun itself be killed.
"""
from __future__ import annotations

import os
import selectors
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO, TextIO

from launcher.contract import TORCH_VARIABLE_NAMES
from launcher.failures import Failure, FailureScanner
from launcher.lifeline import Lifeline
from launcher.processes import leftover_processes
from launcher.rank_stderr import DIRECTORY_VARIABLE, RankStderr
from launcher.stderr_filter import FailureReport, StderrFilter

__all__ = ["JobResult", "run_job"]

# Once a rank has failed (a psrt marker, which comes just before MPI Abort, or
# a launcher notice) the job normally ends within a second; if it is still
# running this long afterwards, the abort is stuck and psrun ends the job.
ABORT_GRACE_S = 5.0
_KILL_GRACE_S = 3.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# The scanner's key for mpirun's stdout, and how much of an unfinished stdout line it keeps.
_STDOUT = "mpirun stdout"
_PARTIAL_SCANNED = 4096


@dataclass(frozen=True)
class JobResult:
    """How the job ended: psrun's exit code, the failure that headlines it if one was named
    (the first rank that failed, or the rank a stall report blamed), and the signal psrun
    passed on to mpirun if the user stopped the job."""

    returncode: int
    failure: Failure | None
    stopped_by: int | None = None


def _writer(stream: TextIO) -> Callable[[bytes], None]:
    """Write raw bytes to a text stream (through its buffer when it has one) and flush."""
    buffer = getattr(stream, "buffer", None)

    def write(chunk: bytes) -> None:
        try:
            if buffer is not None:
                buffer.write(chunk)
                buffer.flush()
            else:
                stream.write(chunk.decode("utf-8", errors="replace"))
                stream.flush()
        except (OSError, ValueError):
            # Our own stdout went away (closed pipe): keep draining mpirun so it never blocks.
            return

    return write


def _pump(source: BinaryIO, write: Callable[[bytes], None], scan: Callable[[str], None]) -> None:
    """Copy ``source`` to ``write`` until EOF, untouched, and hand each line to ``scan`` too:
    Hydra (MPICH, Intel MPI) reports the ranks' ends on its stdout."""
    fd, partial = source.fileno(), b""
    while chunk := os.read(fd, 65536):
        write(chunk)
        *lines, partial = (partial + chunk).split(b"\n")
        for line in lines:
            scan(line.decode("utf-8", errors="replace"))
        partial = partial[-_PARTIAL_SCANNED:]
    source.close()


def _read_stderr(mpirun_stderr: BinaryIO, ranks: RankStderr | None, view: StderrFilter,
                 stop: threading.Event) -> None:
    """Feed every stderr source to ``view`` until each has ended (or ``stop`` is set)."""
    selector = selectors.DefaultSelector()
    os.set_blocking(mpirun_stderr.fileno(), False)
    selector.register(mpirun_stderr.fileno(), selectors.EVENT_READ, None)
    for rank, fd in (ranks.readers.items() if ranks is not None else ()):
        selector.register(fd, selectors.EVENT_READ, rank)
    while selector.get_map() and not stop.is_set():
        # The ranks' own output first: it was written before mpirun could report their end.
        closed = []
        for key, _ in sorted(selector.select(timeout=0.1), key=lambda ready: ready[0].data is None):
            try:
                chunk = os.read(key.fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                view.feed(key.data, chunk, time.monotonic())
            else:
                selector.unregister(key.fd)
                view.end_of(key.data, time.monotonic())
                closed += [key.data] if key.data is not None else []
        if closed:  # ranks whose stderr closed in one wake-up: which ended first is unknown
            view.scanner.ended(closed)
        view.tick(time.monotonic())
    selector.close()
    mpirun_stderr.close()


def _install_forwarding(proc: subprocess.Popen[bytes],
                        on_signal: Callable[[int], None]) -> dict[int, object]:
    """Send SIGINT/SIGTERM/SIGHUP received by psrun on to mpirun; returns the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}  # handlers can only be set from the main thread

    def forward(signum: int, _frame: object) -> None:
        on_signal(signum)
        if proc.poll() is None:
            # Open MPI treats SIGHUP as fatal without cleanup; ask it to terminate instead.
            proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    return {int(s): signal.signal(s, forward) for s in _FORWARDED}


def _wait(proc: subprocess.Popen[bytes], scanner: FailureScanner) -> int:
    """Wait for mpirun; end it if it lingers long after a rank reported a failure."""
    failed_at: float | None = None
    terminated_at: float | None = None
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if failed_at is None and scanner.failure is not None:
            failed_at = now
        if failed_at is not None and terminated_at is None and now - failed_at > ABORT_GRACE_S:
            print(f"psrun: job still running {ABORT_GRACE_S:g} s after a rank failed; terminating it",
                  file=sys.stderr, flush=True)
            proc.terminate()
            terminated_at = now
        elif terminated_at is not None and now - terminated_at > _KILL_GRACE_S:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _end_leftovers(session: int) -> None:
    """Kill what a failed job left running on this host, saying so."""
    leftovers = leftover_processes(session)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if leftovers:
        print(f"psrun: killed {len(leftovers)} process{'es' if len(leftovers) > 1 else ''} the job left "
              f"behind on this host (pid {', '.join(map(str, leftovers))})", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class JobCommand:
    """An mpirun command line, and how many ranks send their stderr to psrun's own pipes
    (it was built with :func:`launcher.rank_stderr.wrap_command`; 0: none, mpirun merges it)."""

    argv: tuple[str, ...]
    rank_stderr: int = 0
    rank_hosts: tuple[str, ...] = ()  # the host of each rank, where known

    def ranks_on(self, host: str) -> list[int]:
        """The ranks placed on ``host`` (none where the placement is unknown)."""
        return [rank for rank, name in enumerate(self.rank_hosts) if name == host]

    def __str__(self) -> str:
        return shlex.join(self.argv)


def run_job(command: JobCommand, env: Mapping[str, str], *, verbose: bool = False) -> JobResult:
    """Run ``command`` to completion.

    Returns mpirun's exit code (128 + N if mpirun itself died from signal N,
    as a shell reports it) and the failure that headlines the job, from its stderr.
    Once the user stops the job, ranks dying is the expected outcome, so only
    a failure reported before the stop signal counts. ``verbose``: show all of
    stderr, even once the job fails.
    """
    ranks = _rank_pipes(command.rank_stderr)
    scanner = FailureScanner(ranks.rank_of_pid if ranks is not None else lambda pid: None, command.ranks_on)
    view = StderrFilter(scanner, _writer(sys.stderr), verbose=verbose, labelled=ranks is not None)
    lifeline = Lifeline()
    proc = _start(command, env, ranks, lifeline)
    assert proc.stdout is not None and proc.stderr is not None
    stop_reading = threading.Event()
    readers = [
        threading.Thread(target=_pump, args=(proc.stdout, _writer(sys.stdout),
                                             lambda line: scanner.feed(line, _STDOUT)), daemon=True),
        threading.Thread(target=_read_stderr, args=(proc.stderr, ranks, view, stop_reading), daemon=True),
    ]
    stops: list[tuple[int, Failure | None]] = []

    def on_signal(signum: int) -> None:
        if not stops:
            stops.append((signum, scanner.failure))

    old_handlers = _install_forwarding(proc, on_signal)
    try:
        for reader in readers:
            reader.start()
        returncode = _wait(proc, scanner)
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
    if ranks is not None:
        ranks.stop_waiting()
    if returncode != 0 or scanner.failure is not None:
        _end_leftovers(proc.pid)
    _finish_reading(readers, stop_reading, ranks)
    lifeline.release()
    _point_to_log(view.finish())
    returncode = 128 - returncode if returncode < 0 else returncode
    if stops:
        signum, failure_before_stop = stops[0]
        return JobResult(returncode, failure_before_stop, signum)
    return JobResult(returncode, scanner.failure)


def _rank_pipes(num_ranks: int) -> RankStderr | None:
    """Pipes for the ranks' stderr, or None (mpirun's merged stream) where none can be made."""
    if num_ranks <= 0:
        return None
    try:
        return RankStderr(num_ranks)
    except OSError as e:
        print(f"psrun: warning: cannot make pipes for the ranks' stderr ({e}); their output comes "
              "through mpirun, merged", file=sys.stderr, flush=True)
        return None


def _start(command: JobCommand, env: Mapping[str, str], ranks: RankStderr | None,
           lifeline: Lifeline) -> subprocess.Popen[bytes]:
    """Start mpirun in a session of its own, watched by ``lifeline``; on failure, undo the rest."""
    job_env = dict(env)
    job_env.pop(DIRECTORY_VARIABLE, None)  # a psrun inside a rank of another must not use its pipes
    # nor give its ranks that rank's place (the wrapper and init() keep a value a rank has)
    for name in TORCH_VARIABLE_NAMES:
        job_env.pop(name, None)
    if ranks is not None:
        job_env[DIRECTORY_VARIABLE] = ranks.directory
    try:
        proc = subprocess.Popen(list(command.argv), env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError:
        lifeline.release()
        if ranks is not None:
            ranks.close()
        raise
    lifeline.watch(proc.pid, leftover_paths=[ranks.directory] if ranks is not None else [])
    return proc


def _finish_reading(readers: Sequence[threading.Thread], stop: threading.Event, ranks: RankStderr | None) -> None:
    """Let the readers drain what mpirun and the ranks wrote. A rank orphaned by a crashed
    mpirun may hold a pipe open: do not wait for it forever."""
    for reader in readers:
        reader.join(timeout=5.0)
    stop.set()
    readers[-1].join(timeout=1.0)
    if ranks is not None:
        ranks.remove()
        if not readers[-1].is_alive():
            ranks.close()


def _point_to_log(report: FailureReport) -> None:
    if report.log_path is not None:
        print(f"psrun: {report.hidden_lines} more line{'s' if report.hidden_lines != 1 else ''} of the job's "
              f"stderr, not shown here, {'are' if report.hidden_lines != 1 else 'is'} in {report.log_path} "
              "(--verbose shows them all)", file=sys.stderr, flush=True)
