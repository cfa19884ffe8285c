"""launcher/listeners.py against a made-up /proc: which sockets a process tree listens on, in
IPv4 and IPv6 and in another network namespace, which are exposed, and psrun's note."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from launcher.listeners import Listener, exposed, launcher_listeners, listening, note, process_tree

TCP_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def word(octets: bytes) -> str:
    """32 bits of an address as the kernel prints them: one word in the host's byte order."""
    return f"{int.from_bytes(octets, sys.byteorder):08X}"


def row(address: bytes, port: int, state: str, inode: int) -> str:
    hexed = "".join(word(address[i:i + 4]) for i in range(0, len(address), 4))
    return f"   0: {hexed}:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000 0 0 {inode} 1\n"


def process(root: Path, pid: int, parent: int, name: str, sockets: list[int], namespace: str = "net:[1]",
            rank: bool = False, tcp: str = "", tcp6: str = "") -> None:
    directory = root / str(pid)
    (directory / "fd").mkdir(parents=True)
    (directory / "net").mkdir()
    (directory / "ns").mkdir()
    (directory / "stat").write_text(f"{pid} ({name}) S {parent} {pid} {pid} 0")
    (directory / "comm").write_text(name + "\n")
    (directory / "environ").write_bytes(b"PATH=/bin\0" + (b"OMPI_COMM_WORLD_RANK=0\0" if rank else b""))
    os.symlink(namespace, directory / "ns" / "net")
    for fd, inode in enumerate(sockets, start=3):
        os.symlink(f"socket:[{inode}]", directory / "fd" / str(fd))
    os.symlink("/dev/null", directory / "fd" / "0")
    (directory / "net" / "tcp").write_text(TCP_HEADER + tcp)
    (directory / "net" / "tcp6").write_text(TCP_HEADER + tcp6)


def job(root: Path) -> None:
    """psrun (10) -> prterun (11) -> a rank (12); prted (13) in another namespace, under prterun."""
    here_v4 = (row(bytes([127, 0, 0, 1]), 5000, "0A", 100) + row(bytes(4), 5001, "0A", 101)
               + row(bytes([10, 0, 0, 2]), 5002, "01", 102) + row(bytes([10, 0, 0, 2]), 5003, "0A", 103))
    here_v6 = row(bytes(16), 5004, "0A", 104) + row(bytes(10) + b"\xff\xff" + bytes([127, 0, 0, 1]), 5005, "0A", 105)
    process(root, 10, 1, "python", [], tcp=here_v4, tcp6=here_v6)
    process(root, 11, 10, "prterun", [100, 101, 104], tcp=here_v4, tcp6=here_v6)
    process(root, 12, 11, "python", [101, 102, 103, 105], rank=True, tcp=here_v4, tcp6=here_v6)
    process(root, 13, 11, "prted", [200], namespace="net:[2]", tcp=row(bytes(4), 6000, "0A", 200))
    process(root, 20, 1, "other", [104], tcp=here_v4, tcp6=here_v6)


def test_a_tree_lists_each_listening_socket_once_in_its_own_namespace(tmp_path: Path) -> None:
    job(tmp_path)
    root = str(tmp_path)
    assert process_tree(10, root) == [10, 11, 12, 13]
    assert process_tree(99, root) == []
    found = listening(process_tree(10, root), root)
    # 101 is shared with the rank (inherited): named once, by its first holder; 102 is not listening
    assert [(s.pid, s.program, str(s)) for s in found] == [
        (11, "prterun", "127.0.0.1:5000"), (11, "prterun", "0.0.0.0:5001"), (11, "prterun", "[::]:5004"),
        (12, "python", "10.0.0.2:5003"), (12, "python", "[::ffff:7f00:1]:5005"),
        (13, "prted", "0.0.0.0:6000")]
    assert [str(s) for s in exposed(found)] == ["0.0.0.0:5001", "[::]:5004", "10.0.0.2:5003", "0.0.0.0:6000"]
    assert [str(s) for s in exposed(found, allowed=["10.0.0.2"])] == ["0.0.0.0:5001", "[::]:5004", "0.0.0.0:6000"]


def test_the_launchers_listeners_leave_out_psrun_and_the_ranks(tmp_path: Path) -> None:
    job(tmp_path)
    assert [(s.program, str(s)) for s in launcher_listeners(10, str(tmp_path))] == [
        ("prterun", "0.0.0.0:5001"), ("prterun", "[::]:5004"), ("prted", "0.0.0.0:6000")]


def test_the_note_names_each_program_and_address_once() -> None:
    sockets = [Listener(1, "prterun", "0.0.0.0", 41234), Listener(1, "prterun", "::", 41235)]
    assert note("Open MPI", sockets, spans_hosts=False) == (
        "psrun: note: Open MPI's prterun listens on 0.0.0.0:41234 and [::]:41235 for this job (it binds every "
        "address; see docs/guides/cluster.md#trust-model, --no-listener-note silences this)")
    across = note("MPICH", [Listener(1, "mpiexec", "0.0.0.0", 7)], spans_hosts=True)
    assert across.startswith("psrun: note: MPICH's mpiexec listens on 0.0.0.0:7 for this job, and its daemons on "
                             "the other hosts do the same (")
    assert "btl tcp" in note("Open MPI", sockets, spans_hosts=True) and "btl tcp" not in across
