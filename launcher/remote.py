"""Reaching other hosts: the launch agent and the networks psrun passes to mpirun,
checked before anything is launched.

Names only work when every host calls its interface the same; a CIDR matches whatever
each host calls the interface that carries an address in it.  MPICH's Hydra takes less
than Open MPI (one agent executable, one interface name): asking it for more is an
error that says so, not a silently different job.
"""
from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Sequence

from launcher.mpi import LaunchError, MpiFlavour, user_sets_mca

__all__ = ["checked_launch_agent", "checked_networks"]

# Parameters the network flags set; the same names in --mpi-args would contradict them.
_NETWORK_MCA = ("btl_tcp_if_include", "btl_tcp_if_exclude", "oob_tcp_if_include", "oob_tcp_if_exclude")
_AGENT_MCA = ("plm_rsh_agent", "plm_ssh_agent")


def checked_launch_agent(agent: str | None, flavour: MpiFlavour, mpi_args: Sequence[str]) -> str | None:
    """The launch agent, stripped, once it is known that this MPI can run it as given."""
    if agent is None:
        return None
    agent = agent.strip()
    if not agent:
        raise LaunchError('--launch-agent is empty; give the command that starts a program on a host '
                          'the way ssh does (AGENT HOST COMMAND...), e.g. "ssh -p 2222"')
    if flavour.hydra:
        if len(agent.split()) > 1:
            raise LaunchError(f"--launch-agent {agent!r}: MPICH's Hydra runs the agent as one executable "
                              "without arguments (-launcher-exec); put the command in a script and give its path")
        if any(flag in mpi_args for flag in ("-launcher-exec", "-bootstrap-exec")):
            raise LaunchError("--launch-agent and --mpi-args -launcher-exec both choose the launch agent; keep one")
        return agent
    if shlex.split(agent) != agent.split():
        raise LaunchError(f"--launch-agent {agent!r}: Open MPI splits the agent at spaces and ignores quotes "
                          "and backslashes; put the command in a script and give its path")
    if any(user_sets_mca(name, {}, mpi_args) for name in _AGENT_MCA):
        raise LaunchError("--launch-agent and --mpi-args both set plm_rsh_agent; keep one")
    return agent


def checked_networks(interfaces: Sequence[str], cidrs: Sequence[str], flavour: MpiFlavour,
                      mpi_args: Sequence[str]) -> tuple[str, ...]:
    """Interface names and normalised IPv4 networks, in the order given, once each is valid for this MPI.

    Names only work when every host calls its interface the same; a CIDR matches
    whatever each host calls the interface that carries an address in it.
    """
    names = []
    for name in interfaces:
        if "/" in name:
            raise LaunchError(f"--network-interface {name!r} looks like a network; pass it to --network-cidr")
        if not name or any(c.isspace() for c in name):
            raise LaunchError(f"--network-interface {name!r} is not an interface name; give names such as "
                              "eth0,ib0 (see `ip link` on each host)")
        names.append(name)
    networks = []
    for text in cidrs:
        if "/" not in text:
            raise LaunchError(f"--network-cidr {text!r} has no prefix length; write a network as ADDRESS/BITS, "
                              "e.g. 10.0.0.0/24")
        try:
            network = ipaddress.ip_network(text, strict=False)
        except ValueError as e:
            raise LaunchError(f"--network-cidr {text!r} is not a network ({e}); write it as ADDRESS/BITS, "
                              "e.g. 10.0.0.0/24") from None
        if network.version != 4:
            raise LaunchError(f"--network-cidr {text!r} is an IPv6 network; Open MPI selects networks by CIDR "
                              "for IPv4 only: name the interface with --network-interface instead")
        networks.append(str(network))
    if flavour.hydra:
        if networks:
            raise LaunchError("--network-cidr needs Open MPI: MPICH's Hydra selects a network by interface "
                              "name only (-iface); use --network-interface NAME")
        if len(names) > 1:
            raise LaunchError(f"--network-interface {','.join(names)}: MPICH's Hydra takes one interface "
                              "(-iface), named the same on every host; give one name")
        if names and "-iface" in mpi_args:
            raise LaunchError("--network-interface and --mpi-args -iface both choose the network; keep one")
    elif (names or networks) and any(user_sets_mca(name, {}, mpi_args) for name in _NETWORK_MCA):
        raise LaunchError("--network-interface/--network-cidr and --mpi-args both choose the TCP networks "
                          "(btl_tcp_if_include/exclude or oob_tcp_if_include/exclude); keep one")
    return (*names, *networks)
