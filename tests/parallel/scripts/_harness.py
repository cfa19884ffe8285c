"""Runs a list of named checks on every rank of one job and reports each on rank 0.

A check is a function that raises (normally ``AssertionError`` with a detail)
when the calling rank's own output is wrong.  After each check the ranks'
outcomes are gathered and rank 0 prints one JSON line::

    {"check": "allreduce/float32/Sum", "ok": true, "detail": "", "seconds": 0.001}

An exception inside a check is a failed check, not a crashed job.  A check
that does not finish on every rank within ``check_timeout_s`` (a hang) makes
rank 0 print a line with ``"hung": true`` and end the job, since MPI cannot
recover from a half-finished collective.  The last line is ``{"done": N}``.
"""
from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import traceback
from typing import Callable

import psrt.runtime

CHECK_TIMEOUT_S = 20.0
_HANG_EXIT_CODE = 3


class Checks:
    """An ordered registry of named checks; names must be unique."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, Callable[[], None]]] = []

    def add(self, name: str, function: Callable[..., None], *args: object) -> None:
        """Register ``function(name, *args)``; the name doubles as the key of its inputs."""
        if any(name == known for known, _ in self.entries):
            raise ValueError(f"check {name!r} registered twice")
        self.entries.append((name, lambda: function(name, *args)))


def _emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _describe(exc: BaseException) -> str:
    """Type, message, the line of the check that failed and, if elsewhere, where it was raised."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is run() calling the check
    here = os.path.dirname(os.path.abspath(__file__))
    helpers = {"_harness.py", "_reference.py"}
    in_checks = [f for f in frames if os.path.dirname(os.path.abspath(f.filename)) == here
                 and os.path.basename(f.filename) not in helpers]
    sites = [f"{os.path.basename(f.filename)}:{f.lineno}" for f in (in_checks[-1:] + frames[-1:])]
    where = sites[0] if len(set(sites)) == 1 else f"{sites[0]}, raised in {sites[-1]}"
    return f"{type(exc).__name__}: {exc} [{where}]" if sites else f"{type(exc).__name__}: {exc}"


class _Watchdog:
    """Ends the job if the current check runs past its deadline on this rank."""

    def __init__(self, rank: int, limit_s: float) -> None:
        self._rank, self._limit = rank, limit_s
        self._lock = threading.Lock()
        self._name: str | None = None
        self._deadline = 0.0
        self._local = "was still inside the check"
        threading.Thread(target=self._watch, daemon=True, name="check-watchdog").start()

    def arm(self, name: str) -> None:
        with self._lock:
            self._name, self._deadline = name, time.monotonic() + self._limit
            self._local = "was still inside the check"

    def finished_locally(self, ok: bool, detail: str) -> None:
        with self._lock:
            self._local = "had finished it: " + ("ok" if ok else detail)

    def disarm(self) -> None:
        with self._lock:
            self._name = None

    def _watch(self) -> None:
        # Rank 0 reports; the others only leave later, in case rank 0 itself is stuck elsewhere.
        grace = 0.0 if self._rank == 0 else 15.0
        while True:
            time.sleep(0.25)
            with self._lock:
                expired = self._name is not None and time.monotonic() > self._deadline + grace
                name, local = self._name, self._local
            if expired:
                if self._rank == 0:
                    _emit({"check": name, "ok": False, "hung": True, "seconds": self._limit,
                           "detail": f"not finished on every rank within {self._limit:g} s "
                                     f"(hang); rank 0 {local}"})
                os._exit(_HANG_EXIT_CODE)


def run(checks: Checks, check_timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Run every check on every rank (``psrt.init()`` already called) and report on rank 0;
    with ``CHECKS_MATCHING`` (a regular expression) in the environment, only the checks
    whose names it matches (a job that samples a script's checks under another MPI)."""
    pattern = os.environ.get("CHECKS_MATCHING")
    if pattern:
        checks.entries = [(name, function) for name, function in checks.entries if re.search(pattern, name)]
    world = psrt.runtime.current().topology.world
    # Outcomes travel on a communicator of their own, so they can never be matched
    # with a collective a failed check left behind on the world communicator.
    reporting = world.split(0)
    watchdog = _Watchdog(world.rank, check_timeout_s)
    for name, function in checks.entries:
        watchdog.arm(name)
        start = time.perf_counter()
        try:
            function()
            ok, detail = True, ""
        except Exception as exc:  # a failed check is reported, never a crash
            ok, detail = False, _describe(exc)
        seconds = time.perf_counter() - start
        watchdog.finished_locally(ok, detail)
        outcomes = reporting.allgather_object((ok, detail[:1500], seconds))
        watchdog.disarm()
        if world.rank == 0:
            failures = [f"rank {r}: {d}" for r, (good, d, _) in enumerate(outcomes) if not good]
            _emit({"check": name, "ok": not failures, "detail": "; ".join(failures),
                   "seconds": round(max(s for _, _, s in outcomes), 4)})
    if world.rank == 0:
        _emit({"done": len(checks.entries)})
