"""What of a job's stderr psrun shows: all of it while the job runs, little once it fails.

While no rank has failed, every rank's stderr reaches the terminal as it comes, chunk by
chunk, so that progress bars redrawn with ``\\r`` still move. Once a rank fails, the rest is
noise: each other rank's traceback of the same error, Open MPI's banners about the abort,
the ranks it killed. So psrun shows the first failing rank's traceback once, writes
everything else to a log file whose name it prints before its summary, and shows it all
under ``--verbose``.

A traceback is only known to be a failure once the marker that follows it arrives (or the
launcher's notice that its rank exited), so a source's stderr is held back from the line
``Traceback (most recent call last):`` on, and likewise from the dashed rule that opens an
MPI banner: a failure that follows decides that the held lines go to the log (the
traceback is shown once), and otherwise they are shown after :data:`HOLD_S`, or when the
banner's closing rule comes. Lines are told apart by source: each rank's own stderr where
psrun reads it directly (:mod:`launcher.rank_stderr`), else mpirun's merged stream, where
tracebacks of several ranks may interleave.

Open MPI writes stray NUL bytes into its output; they are dropped from what is shown.
"""
from __future__ import annotations

import os
import re
import tempfile
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import TextIO

from launcher.failures import BLAME, MARKER, FailureKind, FailureScanner

__all__ = ["HOLD_S", "FailureReport", "StderrFilter"]

# How long a traceback or an open banner is held back when no failure follows it.
HOLD_S = 3.0
# Lines kept from before a failure, to be written to the log when one comes.
_LOG_LINES_BEFORE = 2000
# An unfinished line (a progress bar redrawn with \r) is kept only this long for scanning.
_PARTIAL_KEPT = 8192
_TRACEBACK = "Traceback (most recent call last):"
_TRACEBACK_BYTES = _TRACEBACK.encode()
# Open MPI frames its banners with a row of dashes, MPICH's Hydra with "=".
_RULE = re.compile(r"^\s*(?:-{40,}|={40,})\s*$")


def _traceback_header(raw: bytes, shown: int) -> int | None:
    """Where a traceback's first line starts in the line ``raw``, if the line ends with it
    (after a progress bar left unfinished, maybe) and that part is not shown yet."""
    start = raw.rfind(_TRACEBACK_BYTES)
    if start < shown or raw[start:].rstrip(b"\0 \t\r\n") != _TRACEBACK_BYTES:
        return None
    return start


@dataclass
class _Stream:
    """One source of stderr: a rank's own, or mpirun's (None)."""

    label: str
    partial: bytes = b""  # the unfinished last line, for scanning
    partial_shown: bool = False  # the start of that line already went to the terminal
    held: list[bytes] | None = None  # lines held back since a traceback or banner began
    held_since: float = 0.0
    hold_ends_at_rule: bool = False  # a banner: held until its closing rule


@dataclass
class FailureReport:
    """What psrun adds above its summary of a failed job: the log holding what it did not show."""

    log_path: str | None = None
    hidden_lines: int = 0


@dataclass
class StderrFilter:
    """Takes the job's stderr, chunk by chunk and source by source; writes what is shown
    through ``show`` and feeds every line to ``scanner``. ``labelled``: sources are the ranks'
    own streams, and the log says which rank wrote each line. Not thread-safe: one thread
    feeds it."""

    scanner: FailureScanner
    show: Callable[[bytes], None]
    verbose: bool = False
    labelled: bool = False
    log_dir: str | None = None
    _streams: dict[Hashable, _Stream] = field(default_factory=dict)
    _before: deque[str] = field(default_factory=lambda: deque(maxlen=_LOG_LINES_BEFORE))
    _log: TextIO | None = None
    _log_path: str | None = None
    _hidden: int = 0
    _traceback_shown: bool = False
    _line_open: bool = False  # what was shown last did not end its line

    def feed(self, source: Hashable, data: bytes, now: float) -> None:
        """``data`` arrived from ``source`` at time ``now``."""
        stream = self._stream(source)
        if self.verbose:
            self._show(data)
        shown = len(stream.partial) if stream.partial_shown else 0
        *lines, rest = (stream.partial + data).split(b"\n")
        for line in lines:
            self._line(source, stream, line + b"\n", shown, now)
            shown = 0
        new = rest if lines else data
        stream.partial = rest
        if new and not self.verbose and stream.held is None and not self._failing():
            self._show(new)
            stream.partial_shown = True
        if len(stream.partial) > _PARTIAL_KEPT:  # a line redrawn forever: keep its end for scanning
            stream.partial = stream.partial[-_PARTIAL_KEPT:]

    def end_of(self, source: Hashable, now: float) -> None:
        """``source`` reached end-of-file: its unfinished last line counts as a line."""
        stream = self._stream(source)
        if stream.partial:
            line, shown = stream.partial, len(stream.partial) if stream.partial_shown else 0
            stream.partial = b""
            self._line(source, stream, line + b"\n", shown, now)

    def tick(self, now: float) -> None:
        """Show what was held back longer than :data:`HOLD_S` with no failure since."""
        if self._failing():
            return
        for stream in self._streams.values():
            if stream.held is not None and now - stream.held_since >= HOLD_S:
                self._release(stream)

    def finish(self) -> FailureReport:
        """The job is over: show what is still held if it did not fail; else show the failing
        rank's traceback if no other was shown, and close the log."""
        failure = self.scanner.failure
        if failure is None:
            for stream in self._streams.values():
                if stream.held is not None:
                    self._release(stream)
            self._end_open_line()
            return FailureReport()
        if not self._traceback_shown and failure.kind in (FailureKind.EXIT, FailureKind.ABORT):
            self._show_traceback(self._streams.get(failure.rank) or self._streams.get(None))
        for stream in self._streams.values():
            if stream.held is not None:
                self._hidden += sum(1 for line in stream.held if _counts_as_hidden(line))
                stream.held = None
        if self._log is not None:
            self._log.close()
            self._log = None
        self._end_open_line()
        return FailureReport(self._log_path if self._hidden else None, self._hidden)

    # --- one line -----------------------------------------------------------------------

    def _line(self, source: Hashable, stream: _Stream, raw: bytes, shown: int, now: float) -> None:
        """A complete line (``raw``, ending in a newline) from ``stream``; its first ``shown``
        bytes already reached the terminal as an unfinished line."""
        stream.partial_shown = False
        if raw.strip(b"\0 \t\r\n") == b"" and b"\0" in raw:
            return  # a line Open MPI's forwarding left with nothing but NUL bytes
        text = raw.replace(b"\0", b"").decode("utf-8", errors="replace").rstrip("\n")
        was_failing = self._failing()
        self.scanner.feed(text, source)
        self._record(stream, text)
        if self.verbose:
            return  # shown as it came
        if was_failing:
            self._hide(text)
            return
        if self._failing():  # this very line made the job a failure
            failure = self.scanner.failure
            if failure is not None and failure.kind in (FailureKind.MARKER, FailureKind.BLAME):
                self._show_traceback(stream)
            self._start_log()
            return
        if stream.held is not None:
            stream.held.append(raw)
            if stream.hold_ends_at_rule and _RULE.match(text):
                self._release(stream)
            return
        header = _traceback_header(raw, shown)
        if header is not None or (not shown and _RULE.match(text)):
            if header:  # a progress bar left unfinished before the traceback's first line
                self._show(raw[shown:header] + b"\n")
            stream.held, stream.held_since = [raw[header or 0:]], now
            stream.hold_ends_at_rule = header is None
            return
        self._show(raw[shown:])

    def _failing(self) -> bool:
        return self.scanner.failure is not None

    def _stream(self, source: Hashable) -> _Stream:
        if source not in self._streams:
            self._streams[source] = _Stream("mpirun" if source is None else f"rank {source}")
        return self._streams[source]

    def _show(self, data: bytes) -> None:
        data = data.replace(b"\0", b"")
        if data:
            self.show(data)
            self._line_open = not data.endswith(b"\n")

    def _end_open_line(self) -> None:
        """End a line left unfinished (a progress bar cut off), so that psrun's own lines
        start lines of their own."""
        if self._line_open:
            self._show(b"\n")

    def _release(self, stream: _Stream) -> None:
        """Show what ``stream`` held back (no failure came), and go on showing it live."""
        held, stream.held = stream.held or [], None
        self._show(b"".join(held))
        if stream.partial:
            self._show(stream.partial)
            stream.partial_shown = True

    def _show_traceback(self, stream: _Stream | None) -> None:
        """Show, once, the traceback ``stream`` held back: its lines up to the failure marker
        (or a blame line, or an MPI banner that the abort printed)."""
        if stream is None or not stream.held or self._traceback_shown:
            return
        lines = list(_traceback_lines(stream.held))
        if lines and lines[0].decode("utf-8", errors="replace").rstrip() == _TRACEBACK:
            self._show(b"".join(lines))
            self._traceback_shown = True
            stream.held = stream.held[len(lines):]

    # --- the log ------------------------------------------------------------------------

    def _record(self, stream: _Stream, text: str) -> None:
        entry = f"[{stream.label}] {text}" if self.labelled else text
        if self._log is not None:
            self._log.write(entry + "\n")
            self._log.flush()
        else:
            self._before.append(entry)

    def _start_log(self) -> None:
        """A failure: write what came before it to a log file that later lines are added to."""
        if self._log is not None or self.verbose:
            return
        try:
            fd, self._log_path = tempfile.mkstemp(prefix="psrun-", suffix=".log", dir=self.log_dir)
            self._log = os.fdopen(fd, "w", encoding="utf-8", errors="replace")
        except OSError:
            self._log_path = None
            return
        self._log.write("".join(line + "\n" for line in self._before))
        self._log.flush()
        self._before.clear()

    def _hide(self, text: str) -> None:
        if _counts_as_hidden(text.encode()):
            self._hidden += 1


def _traceback_lines(held: Iterable[bytes]) -> Iterable[bytes]:
    """The held lines up to the first that is no longer part of a traceback."""
    for line in held:
        text = line.decode("utf-8", errors="replace")
        if MARKER.search(text.rstrip("\n")) or BLAME.search(text.rstrip("\n")) or _RULE.match(text):
            return
        yield line


def _counts_as_hidden(line: bytes) -> bool:
    """Whether a line psrun did not show is worth pointing to the log for: not the failure's
    own marker or blame line (the summary says it), nor blank lines and rules."""
    text = line.decode("utf-8", errors="replace").rstrip("\n").replace("\0", "")
    return bool(text.strip()) and not _RULE.match(text) and not MARKER.search(text) and not BLAME.search(text)
