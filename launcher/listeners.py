"""The TCP sockets a job's processes listen on, read from ``/proc``, and which of them are
exposed: bound to an address beyond loopback and the interfaces the job was told to use.

A process that listens on ``0.0.0.0`` or ``::`` takes connections from anything that can
reach the host.  Some MPI launchers do so whatever they are told (Open MPI's ``prterun`` and
``prted``, Hydra's ``mpiexec`` and proxies, see docs/guides/cluster.md#trust-model): psrun
cannot stop them, so it says so once (:func:`note`), and the tests check that nothing else
of a job listens beyond what it needs.  Each process's sockets are matched (by inode) with
its own network namespace's tables, so processes in other namespaces are read right too.
Linux only; elsewhere nothing is found.
"""
from __future__ import annotations

import ipaddress
import os
import sys
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from launcher.processes import is_rank, parent_of

__all__ = ["Listener", "exposed", "launcher_listeners", "listening", "note", "process_tree", "watch_launcher"]

_LISTEN = "0A"  # the TCP state LISTEN in /proc/net/tcp{,6}
# How often, and how many times, psrun looks for its launcher's listeners: they open within
# a second of its start (Hydra's control port, PRTE's out-of-band listeners), and an elastic
# job's first launch may come later, once enough hosts are there.
_WATCH_EVERY_S = 0.5
_WATCH_TRIES = 120
_SETTLE_S = 1.0  # after the first is found, for the rest (PRTE opens IPv4, then IPv6)


@dataclass(frozen=True)
class Listener:
    """One listening socket: the process that holds it (the first found, where several share
    it, as Hydra's ranks inherit its port), its program name, and where it listens."""

    pid: int
    program: str
    address: str
    port: int

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


def process_tree(root: int, proc_root: str = "/proc") -> list[int]:
    """``root`` and every process descended from it, parents before children; [] if it is gone."""
    children: dict[int, list[int]] = {}
    try:
        entries = [int(entry) for entry in os.listdir(proc_root) if entry.isdigit()]
    except OSError:
        return []
    for pid in entries:
        parent = parent_of(pid, proc_root)
        if parent is not None:
            children.setdefault(parent, []).append(pid)
    if root not in entries:
        return []
    tree, index = [root], 0
    while index < len(tree):
        tree += sorted(children.get(tree[index], ()))
        index += 1
    return tree


def listening(pids: Iterable[int], proc_root: str = "/proc") -> list[Listener]:
    """The listening TCP sockets (IPv4 and IPv6) that ``pids`` hold, each once (socket inodes
    are unique across namespaces), in the order of ``pids``."""
    found: dict[int, Listener] = {}
    tables: dict[str, dict[int, tuple[str, int]]] = {}
    for pid in pids:
        inodes = _socket_inodes(pid, proc_root)
        if not inodes:
            continue
        try:
            namespace = os.readlink(os.path.join(proc_root, str(pid), "ns", "net"))
        except OSError:
            namespace = f"pid {pid}"
        if namespace not in tables:
            tables[namespace] = _listening_table(os.path.join(proc_root, str(pid), "net"))
        for inode in sorted(inodes):
            if inode in tables[namespace] and inode not in found:
                address, port = tables[namespace][inode]
                found[inode] = Listener(pid, _program(pid, proc_root), address, port)
    return list(found.values())


def exposed(listeners: Iterable[Listener], allowed: Collection[str] = ()) -> list[Listener]:
    """The ``listeners`` bound beyond loopback and the ``allowed`` addresses (those of the
    interfaces the job was told to use); every-address binds (``0.0.0.0``, ``::``) always are."""
    allowed_addresses = {ipaddress.ip_address(a) for a in allowed}
    return [listener for listener in listeners if not _contained(listener.address, allowed_addresses)]


def note(flavour: str, listeners: Collection[Listener], *, spans_hosts: bool) -> str:
    """psrun's one line about the launcher's exposed ``listeners`` (non-empty)."""
    by_program: dict[str, list[str]] = {}
    for listener in listeners:
        by_program.setdefault(listener.program, []).append(str(listener))
    parts = [f"{flavour}'s {program} listens on {_and(addresses)}" for program, addresses in by_program.items()]
    remote = ", and its daemons on the other hosts do the same" if spans_hosts else ""
    if spans_hosts and flavour == "Open MPI":  # btl tcp, as prterun, binds the wildcard address
        remote += ", as do the ranks' TCP transport (btl tcp) on every host"
    return (f"psrun: note: {_and(parts)} for this job{remote} (it binds every address; see "
            "docs/guides/cluster.md#trust-model, --no-listener-note silences this)")


def launcher_listeners(root: int, proc_root: str = "/proc") -> list[Listener]:
    """The exposed listeners of the processes under ``root`` (psrun) that are neither
    ``root`` nor a rank: the MPI launcher's, and those of the daemons it started on this host."""
    def launcher_process(pid: int) -> bool:
        try:
            return pid != root and not is_rank(pid, proc_root)
        except OSError:
            return False
    return exposed(listening(filter(launcher_process, process_tree(root, proc_root)), proc_root))


def watch_launcher(say: Callable[[list[Listener]], None], stop: threading.Event) -> threading.Thread:
    """Start a daemon thread that looks for this process's launcher's exposed listeners for a
    while (:data:`_WATCH_TRIES` times), and calls ``say`` once with them if it finds any."""
    def watch() -> None:
        for _ in range(_WATCH_TRIES):
            if stop.wait(_WATCH_EVERY_S):
                return
            if launcher_listeners(os.getpid()):
                found = [] if stop.wait(_SETTLE_S) else launcher_listeners(os.getpid())
                if found and not stop.is_set():
                    say(found)
                return

    thread = threading.Thread(target=watch, name="psrun-listeners", daemon=True)
    thread.start()
    return thread


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _contained(address: str, allowed: set[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip in allowed


def _socket_inodes(pid: int, proc_root: str) -> set[int]:
    directory = os.path.join(proc_root, str(pid), "fd")
    inodes = set()
    try:
        names = os.listdir(directory)
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(os.path.join(directory, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _listening_table(net: str) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of the listening sockets in ``net``'s ``tcp`` and ``tcp6``."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(net, name)) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == _LISTEN:
                hex_address, hex_port = fields[1].split(":")
                table[int(fields[9])] = (_address(hex_address), int(hex_port, 16))
    return table


def _address(hex_address: str) -> str:
    """An address as the kernel prints it: 32-bit words in the host's byte order."""
    raw = b"".join(int(hex_address[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_address), 8))
    return str(ipaddress.ip_address(raw))


def _program(pid: int, proc_root: str) -> str:
    try:
        with open(os.path.join(proc_root, str(pid), "comm")) as f:
            return f.read().strip()
    except OSError:
        return f"pid {pid}"
