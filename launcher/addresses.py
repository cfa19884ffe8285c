"""Whether a host name is this machine, and whether it names any machine at all.

A job whose hosts are all this machine needs no network, so psrun must not mistake a
remote host for this one: that job would start every rank here. A name is this machine
when it is one of its names, or when every address it resolves to is held by one of this
machine's interfaces, as the kernel lists them. Not "any address that binds": all of
127.0.0.0/8 binds wherever loopback is up, yet ``tests/multihost`` gives network namespaces,
separate hosts to MPI, addresses in 127.200.0.0/24. Where the kernel's lists cannot be read
(not Linux), only the loopback names and addresses count.
"""
from __future__ import annotations

import functools
import ipaddress
import os
import socket
from collections.abc import Iterable

__all__ = ["LOCAL_NAMES", "host_addresses", "interface_addresses", "is_local_host", "unknown_hosts"]

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_local_host(name: str) -> bool:
    """True when ``name`` is this machine, so a job on it needs no network."""
    if name in LOCAL_NAMES:
        return True
    me = socket.gethostname()
    if name in (me, me.split(".")[0]):
        return True
    addresses = host_addresses(name)
    mine = interface_addresses()
    return bool(addresses) and all(_normalised(address) in mine for address in addresses)


def unknown_hosts(names: Iterable[str]) -> list[str]:
    """The ``names`` that resolve to no address, in order."""
    return [name for name in names if name not in LOCAL_NAMES and not host_addresses(name)]


def host_addresses(name: str) -> tuple[str, ...]:
    """The addresses ``name`` resolves to; () if it does not resolve (an unknown host, or one
    not in the name service yet: a failed lookup is not remembered)."""
    try:
        return _resolved(name)
    except (OSError, UnicodeError):
        return ()


@functools.cache
def _resolved(name: str) -> tuple[str, ...]:
    return tuple(sorted({str(info[4][0]) for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}))


@functools.cache
def interface_addresses(proc_root: str = "/proc") -> frozenset[str]:
    """The addresses this machine's interfaces hold: the kernel's ``/32 host LOCAL`` routes
    (IPv4) and ``if_inet6`` (IPv6), plus the loopback addresses."""
    found = {"127.0.0.1", "::1"}
    try:
        with open(os.path.join(proc_root, "net", "fib_trie")) as f:
            lines = f.read().splitlines()
        pairs = zip(lines, lines[1:])  # noqa: RUF007 (itertools.pairwise needs Python 3.10)
        found.update(previous.split()[-1] for previous, line in pairs
                     if line.strip() == "/32 host LOCAL" and previous.split())
    except OSError:
        pass
    try:
        with open(os.path.join(proc_root, "net", "if_inet6")) as f:
            found.update(str(ipaddress.IPv6Address(bytes.fromhex(row.split()[0]))) for row in f if row.split())
    except (OSError, ValueError):
        pass
    return frozenset(filter(None, map(_normalised, found)))


def _normalised(address: str) -> str:
    """One spelling per address (``fe80::1%eth0`` and ``FE80:0::1`` alike); '' if not one."""
    try:
        return str(ipaddress.ip_address(address.split("%", 1)[0]))
    except ValueError:
        return ""
