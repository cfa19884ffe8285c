"""Find which rank failed first in the stderr text of an MPI job.

Two kinds of text name a failed rank. The psrt runtime prints one marker line
per uncaught exception (``psrt: rank 1 failed: raised ValueError: boom``)
just before it calls MPI Abort; it is the most precise account, since it says
what the rank raised. The MPI launcher prints its own notices when a rank
exits, dies from a signal or aborts; they cover ranks that never reached the
psrt hook (``os._exit``, the OOM killer, a segfault). Their text wraps over
several lines, so notices are matched against the last few lines joined.

A third kind of line names the culprit rather than the reporter. When a rank's stall report
finds the rank the others wait for (stopped answering, never came), the psrt runtime prints, before
its own marker, ``psrt: rank R blames rank Q (ROLE): WHY`` (the role, such as ``worker 1``,
is optional; R and Q are job ranks). The job is then headlined by Q, the rank to look at,
not by R, which only noticed.

Hydra (MPICH, Intel MPI) says less. Once one rank dies it kills the others with SIGKILL and
then reports every rank's end, in rank order, on its stdout: its notices cannot tell the rank
that died first from those it killed. Where each rank's stderr comes on a pipe of its own,
the pipes close as the ranks end (:meth:`FailureScanner.ended`): a rank whose pipe closed
before any other headlines the job; ranks whose pipes closed together are named together,
since nothing says which of them died first.

The scanner is pure: feed it lines, read :attr:`FailureScanner.failure`. Lines may come
from several sources (each rank's own stderr, and mpirun's stderr and stdout); launcher
notices are matched within one source's recent lines, so that interleaved sources cannot
split a notice. mpirun's stdout is fed from a thread of its own, so the scanner locks.
"""
from __future__ import annotations

import enum
import re
import signal
import threading
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass

from launcher.contract import BLAME_PATTERN, FAILURE_PATTERN

__all__ = ["BLAME", "MARKER", "Failure", "FailureKind", "FailureScanner", "describe_signal"]

# At the start of a line (after mpirun's optional "[1,0]<stderr>:" tag); mpirun interleaves
# its own notices with the ranks' output, so a marker may follow stray whitespace and be
# followed by a notice's dashes.  Not further in: a rank may print another job's output.
_LINE_START = r"^\s*(?:\[[^\]]*\]<std\w+>:\s*)?"
_NOTICE_DASHES = r"(?:-{10,}.*)?$"
# The lines themselves are the ranks' (launcher.contract).
MARKER = re.compile(_LINE_START + FAILURE_PATTERN + _NOTICE_DASHES)
BLAME = re.compile(_LINE_START + BLAME_PATTERN + _NOTICE_DASHES)

_WINDOW_LINES = 8
# Launcher notices, matched against the window of recent lines joined by spaces.
# Open MPI 5 says "prterun", Open MPI 4 says "mpirun".
_SIGNALLED = re.compile(
    r"noticed that process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)"
)
_FIRST_EXIT = re.compile(
    r"The first process to do so was: Process name: (\S+) Exit code: (-?\d+)"
)
_IMPROPER = re.compile(r"due to process rank (\d+) with PID \d+ on node \S+ exiting improperly")
_OMPI_ABORT = re.compile(
    r"MPI_ABORT was invoked on rank (\d+) in communicator \S+"
    r"(?: Proc: (\S+) Errorcode: (-?\d+)| with errorcode (-?\d+))"
)
_OMPI_ABORT_BARE = re.compile(r'due to process rank (\d+) with PID \d+ on node \S+ calling "abort"')
# MPICH / Intel MPI (Hydra) notices.
_HYDRA_BAD = re.compile(
    r"RANK (\d+) PID \d+ RUNNING AT \S+ (?:KILLED BY SIGNAL: (\d+)|EXIT CODE: (-?\d+))"
)
_HYDRA_KILL = "killed by signal 9 (SIGKILL)"  # how Hydra ends the ranks left once one failed
# Open MPI (PRTE in version 5, ORTE before) lost the daemon of a host: the host died or was cut off.
_LOST_DAEMON = re.compile(r"[OP]RTE has lost communication with a remote daemon\..*?Remote daemon: \S+ on node (\S+)")
# MPICH names only the process that failed first, by process id, and how it ended.
_MPICH_END = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES PID (\d+) RUNNING AT \S+ "
                        r"EXIT CODE: -?\d+ .*YOUR APPLICATION TERMINATED WITH THE EXIT STRING: .*\(signal (\d+)\)")
_HYDRA_ABORT = re.compile(r"application called MPI_Abort\(\S+, (-?\d+)\) - process (\d+)")


class FailureKind(enum.Enum):
    """Where a failure report came from; decides which report wins."""

    BLAME = "blame"  # psrt's stall or deadlock report on one rank named another as the cause
    MARKER = "marker"  # psrt's own line: the rank raised an exception
    EXIT = "exit"  # the launcher saw a rank exit non-zero or die from a signal
    ABORT = "abort"  # the launcher saw a rank call MPI_Abort
    HOST = "host"  # the launcher lost a host whose ranks it does not name (``rank`` is -1)


@dataclass(frozen=True)
class Failure:
    """The rank a failed job is headlined by and how it failed, e.g. ``exited with code 1``.

    For a :attr:`FailureKind.BLAME` report, ``rank`` is the culprit, ``role`` its role if the
    report gave one (``worker 1``) and ``reporter`` the rank whose report named it. ``together``
    holds the other ranks that ended at the same moment, the same way, when nothing says
    which of them failed first (Hydra's notices).
    """

    rank: int
    how: str
    kind: FailureKind
    reporter: int | None = None
    role: str | None = None
    together: tuple[int, ...] = ()

    def summary(self) -> str:
        if self.kind is FailureKind.BLAME:
            role = f" ({self.role})" if self.role else ""
            return f"rank {self.rank}{role} is to blame: {self.how} (reported by rank {self.reporter})"
        if self.kind is FailureKind.HOST:
            return self.how
        if self.together:
            ranks = ", ".join(map(str, sorted((self.rank, *self.together))))
            return (f"one of ranks {ranks} failed first: {self.how} (they ended at the same moment; the MPI's "
                    "launcher killed the others and does not say which)")
        return f"rank {self.rank} failed first: {self.how}"


def describe_signal(number: int) -> str:
    """``9`` -> ``signal 9 (SIGKILL)``."""
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def _rank_of_process_name(name: str) -> int | None:
    """Open MPI process names end in the rank: ``[prterun-host-12@1,3]`` or ``[[123,1],3]``."""
    match = re.search(r",(\d+)\]$", name)
    return int(match.group(1)) if match else None


def _lost_host(host: str, ranks: Sequence[int]) -> Failure:
    """The MPI lost its daemon on ``host``: a failure of the host's first rank, naming the host
    and its ranks (a failure of the host alone where its ranks are unknown)."""
    how = f"its host {host} stopped answering (the MPI lost its daemon there)"
    if not ranks:
        return Failure(-1, how.removeprefix("its "), FailureKind.HOST)
    others = f"; ranks {', '.join(map(str, ranks))} ran there" if len(ranks) > 1 else ""
    return Failure(ranks[0], f"{how[:-1]}{others})", FailureKind.EXIT)


def _hydra_end(window: str) -> Failure | None:
    """Hydra's notice of one rank's end (each rank of a failed job gets one), if the latest
    line completed one."""
    if m := _HYDRA_BAD.search(window):
        if m.group(2):
            return Failure(int(m.group(1)), f"killed by {describe_signal(int(m.group(2)))}", FailureKind.EXIT)
        return Failure(int(m.group(1)), f"exited with code {m.group(3)}", FailureKind.EXIT)
    return None


def _notice(window: str) -> Failure | None:
    """The launcher notice completed by the latest line, if any."""
    exit_, abort = FailureKind.EXIT, FailureKind.ABORT
    if m := _SIGNALLED.search(window):
        return Failure(int(m.group(1)), f"killed by {describe_signal(int(m.group(2)))}", exit_)
    if (m := _FIRST_EXIT.search(window)) and (rank := _rank_of_process_name(m.group(1))) is not None:
        return Failure(rank, f"exited with code {m.group(2)}", exit_)
    if m := _IMPROPER.search(window):
        return Failure(int(m.group(1)), "exited without finalizing MPI", exit_)
    if m := _OMPI_ABORT.search(window):
        # "rank N in communicator C" is a rank in C; Proc names the world rank.
        rank = _rank_of_process_name(m.group(2) or "") if m.group(2) else None
        code = m.group(3) or m.group(4)
        return Failure(int(m.group(1)) if rank is None else rank, f"called MPI_Abort with error code {code}", abort)
    if m := _OMPI_ABORT_BARE.search(window):
        return Failure(int(m.group(1)), "called MPI_Abort", abort)
    if m := _HYDRA_ABORT.search(window):
        return Failure(int(m.group(2)), f"called MPI_Abort with error code {m.group(1)}", abort)
    return None


class FailureScanner:
    """Reads a job's stderr line by line and keeps the failure that headlines the job.

    The first report wins, with two exceptions. A psrt marker replaces an earlier
    MPI_Abort notice for the same rank, because psrt prints its marker just before
    aborting and the launcher's notice can overtake it. A blame line (the first one, if
    several) replaces its reporter's own marker and the launcher's notice of that rank: the
    reporter aborts the job just after blaming, and what the launcher then sees is the abort,
    not its cause. Any report of another rank that came first stands: that rank failed on its
    own (a rank that died, say, which elastic mode must drop).
    """

    def __init__(self, rank_of_pid: Callable[[int], int | None] = lambda pid: None,
                 ranks_on_host: Callable[[str], Sequence[int]] = lambda host: ()) -> None:
        """``rank_of_pid`` turns a process id into its rank where psrun knows it
        (:meth:`launcher.rank_stderr.RankStderr.rank_of_pid`), ``ranks_on_host`` a host's
        name into the ranks placed there (none where unknown)."""
        self._rank_of_pid = rank_of_pid
        self._ranks_on_host = ranks_on_host
        self._windows: dict[Hashable, deque[str]] = {}
        self._failure: Failure | None = None
        self._hydra_ends: dict[int, Failure] = {}  # by rank, in the order Hydra reported them
        self._ended: list[tuple[int, ...]] = []  # ranks whose own stderr closed, batch by batch
        self._lock = threading.Lock()

    @property
    def failure(self) -> Failure | None:
        """What headlines the job: a psrt report or another launcher notice, else Hydra's
        notice of the rank(s) whose stderr closed first (else of the first rank it names)."""
        with self._lock:
            if self._failure is not None or not self._hydra_ends:
                return self._failure
            for batch in self._ended:
                first = [rank for rank in batch if rank in self._hydra_ends]
                # Hydra ends the other ranks with SIGKILL: a rank that ended otherwise came first.
                first = [r for r in first if self._hydra_ends[r].how != _HYDRA_KILL] or first
                if first:
                    return Failure(first[0], self._hydra_ends[first[0]].how, FailureKind.EXIT,
                                   together=tuple(first[1:]))
            return next(iter(self._hydra_ends.values()))

    def ended(self, ranks: Collection[int]) -> None:
        """The own stderr of each of ``ranks`` reached end-of-file at once (one wake-up of the
        reader): those processes ended, or closed their stderr."""
        with self._lock:
            self._ended.append(tuple(sorted(ranks)))

    def feed(self, line: str, source: Hashable = None) -> None:
        """Take one line (with or without its newline) from ``source`` (a rank's own stderr,
        None for mpirun's stderr, or another key for mpirun's stdout).  NUL bytes are dropped: Open MPI's output forwarding
        sometimes puts one where the line starts, which would hide a marker from the pattern
        (and turn the report into the launcher's bare abort notice).  Of a line redrawn with
        carriage returns (a progress bar, then a marker) only the last part counts."""
        with self._lock:
            self._feed(line, source)

    def _feed(self, line: str, source: Hashable) -> None:
        line = line.rstrip("\r\n").replace("\x00", "").rsplit("\r", 1)[-1]
        if m := BLAME.search(line):
            self._offer(Failure(int(m.group(2)), m.group(4).strip(), FailureKind.BLAME,
                                reporter=int(m.group(1)), role=m.group(3)))
            return
        if m := MARKER.search(line):
            self._offer(Failure(int(m.group(1)), m.group(2).strip(), FailureKind.MARKER))
            return
        # Hydra frames its notices with "=" characters; drop them and collapse spacing.
        text = " ".join(line.strip().lstrip("=").split())
        if not text or set(text) <= set("-="):
            return
        window = self._windows.setdefault(source, deque(maxlen=_WINDOW_LINES))
        window.append(text)
        if (end := _hydra_end(" ".join(window))) is not None:
            window.clear()
            self._hydra_ends.setdefault(end.rank, end)
        elif (m := _LOST_DAEMON.search(" ".join(window))) is not None:
            window.clear()
            if self._failure is None:
                self._offer(_lost_host(m.group(1), self._ranks_on_host(m.group(1))))
        elif (m := _MPICH_END.search(" ".join(window))) is not None:
            window.clear()
            if self._failure is None and (rank := self._rank_of_pid(int(m.group(1)))) is not None:
                self._offer(Failure(rank, f"killed by {describe_signal(int(m.group(2)))}", FailureKind.EXIT))
        elif self._failure is None:  # a later notice never replaces an earlier one
            found = _notice(" ".join(window))
            if found is not None:
                window.clear()
                self._offer(found)

    def _offer(self, found: Failure) -> None:
        current = self._failure
        if current is None or _overrides(found, current):
            self._failure = found


def _overrides(found: Failure, current: Failure) -> bool:
    """Whether a later report ``found`` says more about the job's failure than ``current``."""
    if found.kind is FailureKind.BLAME:  # the reporter's own report or abort, which the blame explains
        return current.rank == found.reporter
    return (current.kind is FailureKind.ABORT and found.kind is FailureKind.MARKER
            and found.rank == current.rank)
