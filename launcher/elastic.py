"""psrun's elastic mode: keep a job running while hosts fail and come.

An MPI job cannot shrink or grow in place, so psrun supervises it and relaunches it:

- when a rank dies (killed by a signal, or exits without finalizing: a lost process or
  host), the slot group it ran in is blacklisted (:mod:`launcher.blacklist`: for good, or
  for a cooldown that doubles with each loss) and the job relaunched on the groups left;
  a rank that raised an exception is relaunched on the same hosts (its host is fine);
- when usable slots appear below ``--max-np`` (the discovery script reports more, or a
  blacklisted group's cooldown ends), or a group in use disappears, psrun writes
  ``hosts.json`` in the job's elastic directory; the job's next ``state.commit()`` raises
  ``HostsUpdatedInterrupt``, the job stops there (leaving ``reset.json``), and psrun
  relaunches it on the new hosts.  Growth does not count against ``--restarts``;
- when a launch cannot restore its commit (the job leaves ``restore-failed.json``) for the
  same reason as the launch before it, psrun stops: a relaunch cannot mend a damaged commit.

Every launch runs on every usable slot up to ``--max-np``, as Horovod's does; ``-np`` is
only how many slots the first launch waits for.  Below that (``--min-np`` for later
launches) psrun waits, while discovery may report more or a blacklisted group may come back,
up to ``--elastic-timeout``, then fails naming what it had.  A *slot group* is one hostfile
line, ``-H`` entry or discovery line: ``localhost:1`` three times is three groups of one
machine, which is how a single machine rehearses losing a host.  Ranks fill the groups in
order, as mpirun fills slots.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from launcher.blacklist import Blacklist
from launcher.contract import (
    ENV_ELASTIC_DIR,
    ENV_ELASTIC_HOSTS_VERSION,
    ENV_ELASTIC_LAUNCH,
    HOSTS_FILE,
    RESET_FILE,
    RESTORE_FAILED_FILE,
)
from launcher.failures import FailureKind
from launcher.hostfile import Host, HostfileError, is_local_host, merge_hosts, parse_discovery, total_slots
from launcher.monitor import JobCommand, JobResult

__all__ = ["ElasticSettings", "Supervisor", "discover", "rank_groups"]

DISCOVERY_INTERVAL_S = 1.0
DISCOVERY_TIMEOUT_S = 30.0

#: The command line for given hosts (None: this machine), rank count (None: every slot) and
#: extra rank variables; raises LaunchError on what cannot run.
Launch = Callable[[tuple[Host, ...] | None, int | None, Sequence[tuple[str, str]]], JobCommand]
RunJob = Callable[[JobCommand], JobResult]


@dataclass(frozen=True)
class ElasticSettings:
    min_np: int
    max_np: int
    initial_np: int | None  # -np: the slots the first launch waits for (None: --min-np)
    restarts: int
    timeout_s: float
    discovery_script: str | None
    directory: str | None  # None: a fresh temporary directory, removed after success
    cooldown_s: tuple[float, float] | None = None  # --blacklist-cooldown-range (None: out for good)


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


@dataclass(frozen=True)
class _LaunchPlan:
    """Where one launch runs: the usable groups (with their identities), the rank count and
    the groups the ranks fill."""

    keys: list[tuple[str, int]]
    groups: tuple[Host, ...]
    num_proc: int
    used: tuple[Host, ...]


@dataclass
class Supervisor:
    """Launches, watches and relaunches one elastic job; :meth:`run` returns psrun's exit code."""

    settings: ElasticSettings
    static_groups: tuple[Host, ...] | None
    launch: Launch
    run_job: RunJob
    say: Callable[[str], None] = field(default=lambda text: print(f"psrun: elastic: {text}", file=sys.stderr,
                                                                   flush=True))
    blacklist: Blacklist | None = None  # made from the settings' cooldown unless given

    def __post_init__(self) -> None:
        if self.blacklist is None:
            self.blacklist = Blacklist(self.settings.cooldown_s)

    def run(self) -> int:
        settings = self.settings
        directory = settings.directory
        restarts_used, launch, hosts_version = 0, 0, 0
        reason, restore_failure = "start", None
        while True:
            plan = self._plan(reason, first=launch == 0)
            if plan is None:
                return 1
            if not self._directory_usable(plan):
                return 2
            made = directory is None
            if made:  # made once a launch is certain, so early exits leave nothing behind
                directory = tempfile.mkdtemp(prefix="psrt-elastic-")
            os.makedirs(directory, exist_ok=True)
            try:
                command = self.launch(plan.used, plan.num_proc, _rank_env(directory, hosts_version, launch + 1))
            except Exception:  # a command line refused (a host gone from the name service)
                if made and launch == 0:
                    shutil.rmtree(directory, ignore_errors=True)
                raise
            launch += 1
            self.say(f"launch {launch}: {plan.num_proc} ranks on {_describe(plan.used)} ({reason})")
            for name in (RESET_FILE, RESTORE_FAILED_FILE):
                _remove(os.path.join(directory, name))
            watcher = _Watcher(self, directory, plan, hosts_version)
            result = self.run_job(command)
            hosts_version = watcher.stop()
            if result.stopped_by is not None:
                return result.returncode
            if result.returncode == 0 and result.failure is None:
                reset = os.path.join(directory, RESET_FILE)
                if os.path.exists(reset):
                    reason, restore_failure = f"relaunch: {_read_reason(reset)}", None
                    continue
                if settings.directory is None:
                    shutil.rmtree(directory, ignore_errors=True)
                self.say(f"job finished after {launch} launch{'es' if launch > 1 else ''}")
                return 0
            failure = result.failure
            what = failure.summary() if failure is not None else f"mpirun exited with code {result.returncode}"
            previous = restore_failure
            restore_failure = _read_reason(os.path.join(directory, RESTORE_FAILED_FILE), None)
            if restore_failure is not None and restore_failure == previous:
                self.say(f"{what}; giving up: launches {launch - 1} and {launch} could not restore the last commit, "
                         f"both for the same reason, which a relaunch cannot change: {restore_failure}")
                return result.returncode or 1
            if restarts_used >= settings.restarts:
                self.say(f"{what}; giving up: the {settings.restarts} restart(s) allowed (--restarts) are used")
                return result.returncode or 1
            restarts_used += 1
            reason = f"restart {restarts_used} of {settings.restarts} after {what}"
            if failure is not None and failure.kind is FailureKind.EXIT and failure.rank < plan.num_proc:
                lost = rank_groups(plan.groups, plan.num_proc)[failure.rank]
                seconds = self.blacklist.add(plan.keys[lost])
                reason += f"; dropped slot group {plan.groups[lost]}" + \
                    ("" if seconds == math.inf else f" for {seconds:.1f} s (--blacklist-cooldown-range)")

    def _directory_usable(self, plan: _LaunchPlan) -> bool:
        """Whether every host of ``plan`` can see the elastic directory (said when not)."""
        if self.settings.directory is None and not all(is_local_host(g.name) for g in plan.used):
            self.say("error: hosts other than this machine need --elastic-dir on a filesystem they all see")
            return False
        return True

    def dry_run(self, show: Callable[[str], None]) -> int:
        """Say what the first launch would run (its mpirun command line through ``show``),
        without waiting for hosts or running anything; 1 when it could not launch now."""
        plan = self._plan("dry run", first=True, wait=False)
        if plan is None:
            return 1
        if not self._directory_usable(plan):
            return 2
        # Without --elastic-dir a real launch makes a temporary directory; a dry run makes none
        # and shows where it would go.
        directory = os.path.abspath(self.settings.directory) if self.settings.directory else \
            os.path.join(tempfile.gettempdir(), "psrt-elastic-<made-at-launch>")
        self.say(f"dry run: launch 1 would run {plan.num_proc} ranks on {_describe(plan.used)}; later launches "
                 "follow failures (--restarts) and host changes")
        show(str(self.launch(plan.used, plan.num_proc, _rank_env(directory, 0, 1))))
        return 0

    def current_groups(self) -> list[tuple[tuple[str, int], Host]]:
        """The slot groups usable now (discovery's, or the hostfile's, less the blacklisted
        ones), each with its identity in the whole list (which blacklisting must not renumber)."""
        groups = discover(self.settings.discovery_script) if self.settings.discovery_script \
            else self.static_groups or ()
        return [(key, group) for key, group in zip(_keys(groups), groups) if not self.blacklist.excludes(key)]

    def _plan(self, reason: str, *, first: bool, wait: bool = True) -> _LaunchPlan | None:
        """The next launch: every usable slot up to --max-np, once there are at least -np
        (first launch) or --min-np slots; None (after saying why) when there are not enough
        by the deadline, or now when ``wait`` is False."""
        settings = self.settings
        needed = settings.initial_np if first and settings.initial_np else settings.min_np
        asked = f"-np {needed}" if needed != settings.min_np else f"--min-np {needed}"
        deadline = time.monotonic() + settings.timeout_s
        announced = False
        while True:
            try:
                available = self.current_groups()
            except HostfileError as e:
                self.say(f"error: {e}")
                return None
            groups = tuple(group for _, group in available)
            if total_slots(groups) >= needed:
                num_proc = min(settings.max_np, total_slots(groups))
                used = tuple(groups[i] for i in sorted(set(rank_groups(groups, num_proc))))
                return _LaunchPlan([key for key, _ in available], groups, num_proc, used)
            can_wait = bool(settings.discovery_script) or self.blacklist.returns_later()
            if not wait and can_wait:
                self.say(f"{reason}: {total_slots(groups)} usable slot(s) now ({_describe(groups)}), fewer than "
                         f"{asked}: the job would wait up to {settings.timeout_s:g} s (--elastic-timeout) for more")
                return None
            if not can_wait or time.monotonic() >= deadline:
                waited = "" if not can_wait else f" after waiting {settings.timeout_s:g} s (--elastic-timeout)"
                self.say(f"error: {total_slots(groups)} usable slot(s) ({_describe(groups)}), fewer than "
                         f"{asked}{waited} ({reason}); add hosts or lower {asked.split()[0]}")
                return None
            if not announced:
                self.say(f"{total_slots(groups)} usable slot(s), fewer than {asked}: "
                         f"waiting up to {settings.timeout_s:g} s for hosts")
                announced = True
            time.sleep(DISCOVERY_INTERVAL_S)


def _rank_env(directory: str, hosts_version: int, launch: int) -> list[tuple[str, str]]:
    """The variables that tell a launch's ranks where its commits are and which launch it is."""
    return [(ENV_ELASTIC_DIR, os.path.abspath(directory)), (ENV_ELASTIC_HOSTS_VERSION, str(hosts_version)),
            (ENV_ELASTIC_LAUNCH, str(launch))]


class _Watcher:
    """Re-reads the usable groups while a job runs; when the job could grow (usable slots
    beyond its ranks, below --max-np) or a group in use is gone, it writes hosts.json, which
    the job's next commit sees."""

    def __init__(self, supervisor: Supervisor, directory: str, plan: _LaunchPlan, version: int) -> None:
        self.supervisor, self.directory, self.version = supervisor, directory, version
        self.used = {plan.keys[i] for i in rank_groups(plan.groups, plan.num_proc)}
        self.num_proc = plan.num_proc
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
            if grows or not self.used <= keys:
                self.version += 1
                _write_json(os.path.join(self.directory, HOSTS_FILE), {"version": self.version,
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


def _read_reason(path: str, missing: str | None = "the job asked") -> str | None:
    """The reason a job left in ``path`` (``missing`` when there is none), removing the file."""
    if not os.path.exists(path):
        return missing
    try:
        with open(path, encoding="utf-8") as f:
            return str(json.load(f).get("reason", "the job asked"))
    except (OSError, ValueError, AttributeError):
        return "the job asked"
    finally:
        _remove(path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
