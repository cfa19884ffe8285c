"""psrun's elastic mode: keep a job running while hosts fail and come.

An MPI job cannot shrink or grow in place, so psrun supervises it and relaunches it:

- when a rank dies (killed by a signal, or exits without finalizing: a lost process or
  host), the slot group it ran in is dropped and the job relaunched on the groups left;
  a rank that raised an exception is relaunched on the same hosts (its host is fine);
- when the host discovery script reports a change, psrun writes ``hosts.json`` in the
  job's elastic directory; the job's next ``state.commit()`` raises
  ``HostsUpdatedInterrupt``, the job stops there (leaving ``reset.json``), and psrun
  relaunches it on the new hosts.  Growth does not count against ``--restarts``.

Every launch gets between ``--min-np`` and ``--max-np`` ranks, as many as the usable
slots allow; below ``--min-np`` psrun waits for the discovery script to report enough
(up to ``--elastic-timeout``), then fails naming what it had.  A *slot group* is one
hostfile line, ``-H`` entry or discovery line: ``localhost:1`` three times is three
groups of one machine, which is how a single machine rehearses losing a host.  Ranks fill
the groups in order, as mpirun fills slots.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from launcher.failures import FailureKind
from launcher.hostfile import Host, HostfileError, is_local_host, merge_hosts, parse_discovery, total_slots
from launcher.monitor import JobResult

__all__ = ["ElasticSettings", "Supervisor", "discover", "rank_groups"]

DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = 30.0
# The names the job reads (psrt.elastic.commits), kept here so psrun needs no torch.
ENV_DIR, ENV_HOSTS_VERSION, ENV_LAUNCH = "PSRT_ELASTIC_DIR", "PSRT_ELASTIC_HOSTS_VERSION", "PSRT_ELASTIC_LAUNCH"
HOSTS, RESET = "hosts.json", "reset.json"

Launch = Callable[[tuple[Host, ...], int, list[tuple[str, str]]], list[str]]
RunJob = Callable[[Sequence[str]], JobResult]


@dataclass(frozen=True)
class ElasticSettings:
    min_np: int
    max_np: int
    initial_np: int | None
    restarts: int
    timeout_s: float
    discovery_script: str | None
    directory: str | None  # None: a fresh temporary directory, removed after success


def discover(script: str) -> tuple[Host, ...]:
    """Run the host discovery script; its slot groups, or HostfileError saying what went wrong."""
    try:
        done = subprocess.run([script], capture_output=True, text=True, timeout=DISCOVERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostfileError(f"host discovery script {script!r} could not run: {e}") from None
    if done.returncode != 0:
        raise HostfileError(f"host discovery script {script!r} exited with code {done.returncode}: "
                            f"{done.stderr.strip()[-500:]}")
    return parse_discovery(done.stdout, script)


def _keys(groups: Sequence[Host]) -> list[tuple[str, int]]:
    """Each slot group's identity: its host name and which of that host's groups it is."""
    seen: dict[str, int] = {}
    keys = []
    for group in groups:
        seen[group.name] = seen.get(group.name, 0) + 1
        keys.append((group.name, seen[group.name]))
    return keys


def rank_groups(groups: Sequence[Host], num_proc: int) -> list[int]:
    """The slot group each rank runs in: mpirun fills the hosts in order (a host's slots
    being all its groups'), and within a host the ranks fill its groups in order."""
    where = []
    for name in (host.name for host in merge_hosts(groups)):
        for index, group in enumerate(groups):
            if group.name == name:
                where.extend([index] * group.slots)
    return where[:num_proc]


def _describe(groups: Sequence[Host]) -> str:
    return ", ".join(str(g) for g in groups) or "none"


@dataclass
class Supervisor:
    """Launches, watches and relaunches one elastic job; :meth:`run` returns psrun's exit code."""

    settings: ElasticSettings
    static_groups: tuple[Host, ...] | None
    launch: Launch
    run_job: RunJob
    say: Callable[[str], None] = field(default=lambda text: print(f"psrun: elastic: {text}", file=sys.stderr,
                                                                   flush=True))
    dropped: set = field(default_factory=set)

    def run(self) -> int:
        settings = self.settings
        directory = settings.directory
        restarts_used, launch, hosts_version = 0, 0, 0
        reason = "start"
        while True:
            available = self._usable_groups(reason)
            if available is None:
                return 1
            keys, groups = [key for key, _ in available], tuple(group for _, group in available)
            num_proc = min(settings.max_np, total_slots(groups),
                           settings.initial_np if launch == 0 and settings.initial_np else settings.max_np)
            used = [groups[i] for i in sorted(set(rank_groups(groups, num_proc)))]
            if settings.directory is None and not all(is_local_host(g.name) for g in used):
                self.say("error: hosts other than this machine need --elastic-dir on a filesystem they all see")
                return 2
            if directory is None:  # made once a launch is certain, so early exits leave nothing behind
                directory = tempfile.mkdtemp(prefix="psrt-elastic-")
            os.makedirs(directory, exist_ok=True)
            launch += 1
            self.say(f"launch {launch}: {num_proc} ranks on {_describe(used)} ({reason})")
            _remove(os.path.join(directory, RESET))
            rank_env = [(ENV_DIR, os.path.abspath(directory)), (ENV_HOSTS_VERSION, str(hosts_version)),
                        (ENV_LAUNCH, str(launch))]
            command = self.launch(tuple(used), num_proc, rank_env)
            watcher = _Watcher(self, directory, keys, groups, num_proc, hosts_version) \
                if settings.discovery_script else None
            result = self.run_job(command)
            if watcher is not None:
                hosts_version = watcher.stop()
            if result.stopped_by is not None:
                return result.returncode
            if result.returncode == 0 and result.failure is None:
                reset = os.path.join(directory, RESET)
                if os.path.exists(reset):
                    reason = f"relaunch: {_read_reason(reset)}"
                    continue
                if settings.directory is None:
                    shutil.rmtree(directory, ignore_errors=True)
                self.say(f"job finished after {launch} launch{'es' if launch > 1 else ''}")
                return 0
            failure = result.failure
            what = failure.summary() if failure is not None else f"mpirun exited with code {result.returncode}"
            if restarts_used >= settings.restarts:
                self.say(f"{what}; giving up: the {settings.restarts} restart(s) allowed (--restarts) are used")
                return result.returncode or 1
            restarts_used += 1
            reason = f"restart {restarts_used} of {settings.restarts} after {what}"
            if failure is not None and failure.kind is FailureKind.EXIT and failure.rank < num_proc:
                lost = rank_groups(groups, num_proc)[failure.rank]
                self.dropped.add(keys[lost])
                reason += f"; dropped slot group {groups[lost]}"

    def current_groups(self) -> list[tuple[tuple[str, int], Host]]:
        """The slot groups known now (discovery's, or the hostfile's), less the dropped ones,
        each with its identity in the whole list (which dropping must not renumber)."""
        groups = discover(self.settings.discovery_script) if self.settings.discovery_script \
            else self.static_groups or ()
        return [(key, group) for key, group in zip(_keys(groups), groups) if key not in self.dropped]

    def _usable_groups(self, reason: str) -> list[tuple[tuple[str, int], Host]] | None:
        """Enough slot groups for ``--min-np``, waiting for discovery to find them; None
        (after saying why) when there are not enough by the deadline."""
        deadline = time.monotonic() + self.settings.timeout_s
        announced = False
        while True:
            try:
                available = self.current_groups()
            except HostfileError as e:
                self.say(f"error: {e}")
                return None
            groups = [group for _, group in available]
            if total_slots(groups) >= self.settings.min_np:
                return available
            if not self.settings.discovery_script or time.monotonic() >= deadline:
                waited = "" if not self.settings.discovery_script else \
                    f" after waiting {self.settings.timeout_s:g} s (--elastic-timeout)"
                self.say(f"error: {total_slots(groups)} usable slot(s) ({_describe(groups)}), fewer than "
                         f"--min-np {self.settings.min_np}{waited} ({reason}); add hosts or lower --min-np")
                return None
            if not announced:
                self.say(f"{total_slots(groups)} usable slot(s), fewer than --min-np {self.settings.min_np}: "
                         f"waiting up to {self.settings.timeout_s:g} s for hosts")
                announced = True
            time.sleep(DISCOVERY_INTERVAL_S)


class _Watcher:
    """Re-runs discovery while a job runs; when the usable groups change in a way that
    matters (room to grow below --max-np, or a group in use gone) it writes hosts.json,
    which the job's next commit sees."""

    def __init__(self, supervisor: Supervisor, directory: str, keys: list[tuple[str, int]],
                 groups: tuple[Host, ...], num_proc: int, version: int) -> None:
        self.supervisor, self.directory, self.version = supervisor, directory, version
        self.launched = set(keys)
        self.used = {keys[i] for i in rank_groups(groups, num_proc)}
        self.num_proc = num_proc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(DISCOVERY_INTERVAL_S):
            try:
                available = self.supervisor.current_groups()
            except HostfileError as e:
                self.supervisor.say(f"warning: {e}")
                continue
            keys, groups = {key for key, _ in available}, [group for _, group in available]
            grows = total_slots(groups) > self.num_proc and self.num_proc < self.supervisor.settings.max_np
            if (keys != self.launched and grows) or not self.used <= keys:
                self.version += 1
                _write_json(os.path.join(self.directory, HOSTS), {"version": self.version,
                                                                  "hosts": [str(g) for g in groups]})
                self.supervisor.say(f"hosts changed to {_describe(groups)}: the job stops at its next commit "
                                    "to be relaunched")
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.version


def _write_json(path: str, document: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(document, f)
    os.replace(path + ".tmp", path)


def _read_reason(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return str(json.load(f).get("reason", "the job asked"))
    except (OSError, ValueError):
        return "the job asked"
    finally:
        _remove(path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
