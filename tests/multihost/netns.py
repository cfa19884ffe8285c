"""A test bed of several "hosts" on one machine, and jobs launched into it through psrun
(used by ``conftest.py``'s fixtures and by ``benchmarks/faults.py``).

Each host is a network namespace with loopback up and one interface, named
differently on every host (as on real clusters, where that breaks selection by
name), carrying an address in 127.200.0.0/24. The interfaces are veth pairs
whose other ends sit on a bridge in a namespace of its own, the switch; taking
a host's switch port down partitions that host from the others. Nothing is
created outside these namespaces, so nothing else on the machine sees them,
and everything is removed afterwards, also when setting up fails half-way.

Addresses in 127.0.0.0/8 normally never leave the loopback interface; each
host sets ``route_localnet`` so that they can cross the veths. Open MPI's TCP
transport excludes 127.0.0.0/8 unless told otherwise, which is exactly what
``--network-cidr`` is for.

psrun runs inside the first host (the node a user logs in to), with a hostfile
of addresses, so no name has to resolve; ``netns_agent.sh`` plays ssh for the
other hosts. The whole bed skips, saying why, where the machine does not allow
it (not root, no ``ip``, ``unshare`` or ``hostname``, namespaces refused, no
Open MPI).
"""
from __future__ import annotations

import atexit
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar
from pathlib import Path

from jobs import REPO, Job, psrun_argv, start_job


HERE = Path(__file__).resolve().parent
AGENT = HERE / "netns_agent.sh"
SUBNET = ipaddress.ip_network("127.200.0.0/24")
# Interface names differ per host on purpose; a host past the list gets net<i>.
_INTERFACE_NAMES = ("eth1", "ens4", "enp3s0", "eno2")
_COMMAND_TIMEOUT_S = 20.0


class SetupRefused(Exception):
    """The machine refused a step of building the test bed (a reason to skip, not a failure)."""


def _run(*argv: str) -> str:
    """Run one set-up command; a refusal becomes :class:`SetupRefused` naming the command."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SetupRefused(f"`{' '.join(argv)}` could not run: {e}") from None
    if done.returncode != 0:
        raise SetupRefused(f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


@dataclass(frozen=True)
class NetHost:
    """One host of the bed: its namespace, address and interface, and its port on the switch."""

    namespace: str
    address: str
    interface: str
    switch_port: str


class Testbed:
    """``count`` hosts joined by a switch; call :meth:`destroy` when done (also after a failed build)."""

    def __init__(self, prefix: str, count: int, workdir: Path) -> None:
        self.prefix = prefix
        self.switch = f"{prefix}sw"
        self.workdir = workdir
        addresses = list(SUBNET.hosts())
        self.hosts = [NetHost(namespace=f"{prefix}h{i}", address=str(addresses[i]),
                              interface=_INTERFACE_NAMES[i] if i < len(_INTERFACE_NAMES) else f"net{i}",
                              switch_port=f"port{i}") for i in range(count)]
        self.map_file = workdir / "hosts.map"
        self._created: list[str] = []
        self._destroyed = False

    # --- building and tearing down ------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def build(self) -> None:
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            self._add_namespace(host.namespace)
            # Made inside the switch with its peer placed straight into the host, so no
            # interface ever appears in the machine's own namespace.
            _run("ip", "-n", self.switch, "link", "add", host.switch_port, "type", "veth",
                 "peer", "name", host.interface, "netns", host.namespace)
            _run("ip", "-n", self.switch, "link", "set", host.switch_port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", host.switch_port, "up")
            # 127/8 addresses may leave loopback only where route_localnet is set.
            settings = " && ".join(f"echo 1 > /proc/sys/net/ipv4/conf/{c}/route_localnet"
                                   for c in ("all", "default", host.interface))
            _run("ip", "netns", "exec", host.namespace, "sh", "-c", settings)
            _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/{SUBNET.prefixlen}",
                 "dev", host.interface)
            _run("ip", "-n", host.namespace, "link", "set", host.interface, "up")
        self.map_file.write_text("".join(f"{h.address} {h.namespace}\n" for h in self.hosts))

    def destroy(self) -> list[str]:
        """Remove every namespace this bed made (ending what still runs inside); returns leftovers."""
        if self._destroyed:
            return []
        self._destroyed = True
        for name in reversed(self._created):
            self._end_processes_in(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=_COMMAND_TIMEOUT_S,
                           check=False)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=_COMMAND_TIMEOUT_S, check=False).stdout
        return [line.split()[0] for line in listed.splitlines() if line.startswith(self.prefix)]

    @staticmethod
    def _end_processes_in(namespace: str) -> None:
        """SIGKILL the processes left in ``namespace``: ranks and daemons our jobs started there."""
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                              timeout=_COMMAND_TIMEOUT_S, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    # --- using it ----------------------------------------------------------------------

    @property
    def launch_agent(self) -> str:
        """The --launch-agent value: Open MPI splits it at spaces, so the paths must have none."""
        return f"/bin/sh {AGENT} {self.map_file}"

    def hostfile(self, slots: int) -> Path:
        path = self.workdir / f"hostfile.{slots}"
        path.write_text("".join(f"{h.address} slots={slots}\n" for h in self.hosts))
        return path

    def psrun(self, *args: str, slots: int, env: Mapping[str, str] | None = None) -> Job:
        """Start ``psrun --hostfile ... args`` inside the first host, reaching the others by agent."""
        argv = ["ip", "netns", "exec", self.hosts[0].namespace,
                *psrun_argv("--hostfile", str(self.hostfile(slots)), "--launch-agent", self.launch_agent,
                            "--network-cidr", str(SUBNET), "--verbose", *args)]
        label = f"two-host `psrun {' '.join(args)}`"
        return start_job(argv, label, env)

    def partition(self, host: NetHost) -> None:
        """Cut ``host`` off the others, as a pulled cable: its interface stays up, nothing arrives."""
        _run("ip", "-n", self.switch, "link", "set", host.switch_port, "down")

    def heal(self, host: NetHost) -> None:
        """Undo :meth:`partition`: end what the cut-off job left on ``host`` (its daemon and
        ranks, which nothing could reach), then plug it back in."""
        self._end_processes_in(host.namespace)
        _run("ip", "-n", self.switch, "link", "set", host.switch_port, "up")


def skip_reason() -> str | None:
    """Why this machine cannot hold the test bed, or None if it should be able to."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    if " " in str(AGENT):
        return f"Open MPI splits the launch agent at spaces, and the repository path {REPO} has one"
    try:
        _run("unshare", "--uts", "true")
    except SetupRefused as e:
        return f"cannot give each host its own hostname: {e}"
    mpirun = Path(sys.executable).parent / "mpirun"
    version = subprocess.run([str(mpirun), "--version"], capture_output=True, text=True, check=False,
                             timeout=30).stdout if mpirun.exists() else ""
    if "Open MPI" not in version:
        return f"the test bed needs Open MPI's mpirun next to {sys.executable} (--network-cidr is Open MPI's)"
    return None


class Bed(Protocol):
    def build(self) -> None: ...
    def destroy(self) -> list[str]: ...


B = TypeVar("B", bound=Bed)


def bed_for_session(make: Callable[[], B], label: str, reason: str | None) -> Iterator[B]:
    """The body of a session fixture: skip, saying why (``reason``, or a set-up step the
    machine refused), else build the bed that ``make`` gives, yield it, and always tear it
    down, failing if any namespace is left behind."""
    import pytest

    if reason is not None:
        pytest.skip(f"{label} unavailable: {reason}")
    bed = make()
    atexit.register(bed.destroy)  # in case the session dies before the fixture's teardown
    try:
        bed.build()
    except SetupRefused as e:
        bed.destroy()
        pytest.skip(f"{label} unavailable: {e}")
    try:
        yield bed
    finally:
        leftovers = bed.destroy()
        assert not leftovers, f"network namespaces left behind: {leftovers}"
