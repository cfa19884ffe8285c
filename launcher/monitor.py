"""Run the mpirun command, pass its output through live, and watch for failures.

Output is copied chunk by chunk, not line by line, so progress bars that
redraw with ``\\r`` still move; stderr is also split into lines for the
:class:`~launcher.failures.FailureScanner`. mpirun runs in its own session so
that a Ctrl-C reaches it once, through psrun, rather than twice (a second
SIGINT makes Open MPI kill the job without cleaning up), and so that once a
failed job is over, any process of it still on this host (a rank that was
stopped, which ignores the SIGTERM Open MPI sends it) is found and killed. A watcher
process (:mod:`launcher.lifeline`) ends the job should psrun itself be killed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO, TextIO

from launcher.failures import Failure, FailureScanner
from launcher.lifeline import Lifeline
from launcher.processes import leftover_processes

__all__ = ["JobResult", "run_job"]

# Once a rank has failed (a psrt marker, which comes just before MPI Abort, or
# a launcher notice) the job normally ends within a second; if it is still
# running this long afterwards, the abort is stuck and psrun ends the job.
ABORT_GRACE_S = 5.0
_KILL_GRACE_S = 3.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class JobResult:
    """How the job ended: psrun's exit code, the first failed rank if one was named,
    and the signal psrun passed on to mpirun if the user stopped the job."""

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


def _pump(source: BinaryIO, write: Callable[[bytes], None], scanner: FailureScanner | None) -> None:
    """Copy ``source`` to ``write`` until EOF, feeding complete lines to ``scanner``.

    With a scanner (stderr, where psrun writes its own summary) an unfinished
    last line is ended, so that the summary starts a line of its own.
    """
    partial = b""
    fd = source.fileno()
    while chunk := os.read(fd, 65536):
        write(chunk)
        if scanner is None:
            continue
        *lines, partial = (partial + chunk).split(b"\n")
        for line in lines:
            scanner.feed(line.decode("utf-8", errors="replace"))
    if scanner is not None and partial:
        scanner.feed(partial.decode("utf-8", errors="replace"))
        write(b"\n")
    source.close()


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


def run_job(command: Sequence[str], env: Mapping[str, str]) -> JobResult:
    """Run ``command`` (an mpirun command line) to completion.

    Returns mpirun's exit code (128 + N if mpirun itself died from signal N,
    as a shell reports it) and the first rank failure found in its stderr.
    Once the user stops the job, ranks dying is the expected outcome, so only
    a failure reported before the stop signal counts.
    """
    scanner = FailureScanner()
    lifeline = Lifeline()
    try:
        proc = subprocess.Popen(
            list(command), env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError:
        lifeline.release()
        raise
    lifeline.watch(proc.pid)
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [
        threading.Thread(target=_pump, args=(proc.stdout, _writer(sys.stdout), None), daemon=True),
        threading.Thread(target=_pump, args=(proc.stderr, _writer(sys.stderr), scanner), daemon=True),
    ]
    stops: list[tuple[int, Failure | None]] = []

    def on_signal(signum: int) -> None:
        if not stops:
            stops.append((signum, scanner.failure))

    old_handlers = _install_forwarding(proc, on_signal)
    try:
        for pump in pumps:
            pump.start()
        returncode = _wait(proc, scanner)
    finally:
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
    if returncode != 0 or scanner.failure is not None:
        _end_leftovers(proc.pid)
    # A rank orphaned by a crashed mpirun may hold the pipes open; do not wait for it forever.
    for pump in pumps:
        pump.join(timeout=5.0)
    lifeline.release()
    returncode = 128 - returncode if returncode < 0 else returncode
    if stops:
        signum, failure_before_stop = stops[0]
        return JobResult(returncode, failure_before_stop, signum)
    return JobResult(returncode, scanner.failure)
