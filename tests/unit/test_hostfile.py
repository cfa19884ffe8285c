"""Hostfiles, -H lists and SLURM allocations all become the same tuple of Host."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from launcher.addresses import host_addresses, interface_addresses, unknown_hosts
from launcher.hostfile import (
    Host,
    HostfileError,
    expand_counts,
    expand_nodelist,
    hosts_from_slurm,
    is_local_host,
    parse_hostfile,
    parse_hosts,
    total_slots,
)

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def test_openmpi_format_with_default_slot_and_ignored_max_slots(tmp_path: Path) -> None:
    path = write(tmp_path, "a slots=4\nb slots = 2 max_slots=8\nc\n")
    assert parse_hostfile(path) == (Host("a", 4), Host("b", 2), Host("c", 1))


def test_mpich_format_and_mixed_formats(tmp_path: Path) -> None:
    path = write(tmp_path, "a:4\nb slots=2\n10.0.0.3:1\n")
    assert parse_hostfile(path) == (Host("a", 4), Host("b", 2), Host("10.0.0.3", 1))


def test_comments_blank_lines_and_trailing_comments_are_ignored(tmp_path: Path) -> None:
    path = write(tmp_path, "# cluster\n\n   \na:2  # two GPUs\n  b slots=3#three\n")
    assert parse_hostfile(path) == (Host("a", 2), Host("b", 3))


def test_repeated_host_sums_its_slots(tmp_path: Path) -> None:
    assert parse_hostfile(write(tmp_path, "a:2\nb\na slots=3\n")) == (Host("a", 5), Host("b", 1))


def test_example_hostfile_parses() -> None:
    hosts = parse_hostfile(str(REPO / "hostfile.example"))
    assert [h.name for h in hosts] == ["node01", "node02", "node03", "10.0.0.14", "node05"]
    assert total_slots(hosts) == 17


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("b:x", "slot count 'x' is not an integer"),
        ("b slots=two", "slot count 'two' is not an integer"),
        ("b:0", "slot count 0 must be a positive integer"),
        ("b slots=-2", "slot count -2 must be a positive integer"),
        ("b:2:3", "expected HOST or HOST:SLOTS"),
        ("b cores=2", "unknown option 'cores'"),
        ("b 4", "expected KEY=VALUE"),
        ("slots=2", "line starts with an option"),
    ],
)
def test_malformed_line_names_file_line_and_text(tmp_path: Path, line: str, fragment: str) -> None:
    path = write(tmp_path, f"# header\na:2\n{line}  # note\n")
    with pytest.raises(HostfileError) as info:
        parse_hostfile(path)
    message = str(info.value)
    assert f"{path}:3:" in message
    assert repr(f"{line}  # note") in message
    assert fragment in message


def test_missing_hostfile(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="hostfile '.*nope' not found"):
        parse_hostfile(str(tmp_path / "nope"))


def test_unreadable_hostfile_is_a_hostfile_error(tmp_path: Path) -> None:
    # A directory cannot be read as a file, even by root.
    with pytest.raises(HostfileError, match="cannot read hostfile"):
        parse_hostfile(str(tmp_path))


def test_hostfile_without_hosts(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="lists no hosts"):
        parse_hostfile(write(tmp_path, "# nothing\n\n"))


def test_dash_h_list() -> None:
    assert parse_hosts("h1:4,h2:4") == (Host("h1", 4), Host("h2", 4))
    assert parse_hosts("h1, h2:2 ,h1") == (Host("h1", 2), Host("h2", 2))


@pytest.mark.parametrize(("spec", "fragment"), [
    ("h1:0", "slot count 0"), ("h1:-1", "slot count -1"), ("h1,,h2", "empty host name"),
    ("", "no hosts given"), ("h1:four", "'four' is not an integer"),
])
def test_dash_h_errors_name_the_bad_value(spec: str, fragment: str) -> None:
    with pytest.raises(HostfileError, match=fragment):
        parse_hosts(spec)


def test_host_rejects_non_positive_slots() -> None:
    with pytest.raises(HostfileError, match="has 0 slots"):
        Host("a", 0)


def test_local_host_names() -> None:
    assert is_local_host("localhost") and is_local_host("127.0.0.1")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("surely-not-this-machine.example")


@pytest.mark.parametrize(("nodelist", "names"), [
    ("gpu5", ["gpu5"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[098-100]", ["n098", "n099", "n100"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("a,b[3],c", ["a", "b3", "c"]),
])
def test_slurm_nodelist_expansion_keeps_zero_padding(nodelist: str, names: list[str]) -> None:
    assert expand_nodelist(nodelist) == names


@pytest.mark.parametrize("nodelist", ["node[01-03", "node[a-c]", "node[3-1]", "a,,b"])
def test_bad_slurm_nodelist(nodelist: str) -> None:
    with pytest.raises(HostfileError, match="SLURM node list"):
        expand_nodelist(nodelist)


def test_slurm_count_expansion() -> None:
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    with pytest.raises(HostfileError, match="bad entry '2x3'"):
        expand_counts("2x3")


def test_hosts_from_slurm_tasks_per_node() -> None:
    env = {"SLURM_JOB_NODELIST": "node[01-03],gpu5", "SLURM_TASKS_PER_NODE": "2(x3),1",
           "SLURM_JOB_CPUS_PER_NODE": "32(x4)"}
    assert hosts_from_slurm(env) == (Host("node01", 2), Host("node02", 2), Host("node03", 2),
                                     Host("gpu5", 1))


def test_hosts_from_slurm_falls_back_to_cpus_per_node() -> None:
    env = {"SLURM_JOB_NODELIST": "c[1-2]", "SLURM_JOB_CPUS_PER_NODE": "8(x2)"}
    assert hosts_from_slurm(env) == (Host("c1", 8), Host("c2", 8))


def test_no_slurm_allocation_means_no_hosts() -> None:
    assert hosts_from_slurm({}) is None


def test_slurm_count_mismatch_is_an_error() -> None:
    env = {"SLURM_JOB_NODELIST": "c[1-3]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    with pytest.raises(HostfileError, match="3 nodes .* gives 2 counts"):
        hosts_from_slurm(env)


def test_slurm_without_counts_is_an_error() -> None:
    with pytest.raises(HostfileError, match="neither SLURM_TASKS_PER_NODE"):
        hosts_from_slurm({"SLURM_JOB_NODELIST": "c1"})


@pytest.mark.parametrize(("count", "fragment"), [
    ("1_0", "'1_0' is not an integer in plain decimal digits"),
    ("\u0661\u0660", "is not an integer in plain decimal digits"),  # Arabic-Indic 10
    ("+3", "'+3' is not an integer in plain decimal digits"),
    ("99999999999999999999", "99999999999999999999 is more than 65536"),
])
def test_slot_counts_are_plain_decimal_within_range(tmp_path: Path, count: str, fragment: str) -> None:
    """int() takes all of these; mpirun would read them differently, or overflow."""
    for text in (f"a:2\nb:{count}\n", f"a:2\nb slots={count}\n"):
        with pytest.raises(HostfileError) as info:
            parse_hostfile(write(tmp_path, text))
        assert f"{tmp_path / 'hosts'}:2: " in str(info.value) and fragment in str(info.value)
    with pytest.raises(HostfileError) as info:
        parse_hosts(f"a:2,b:{count}")
    assert str(info.value).startswith(f"-H 'a:2,b:{count}': slot count ") and fragment in str(info.value)


def test_slurm_counts_are_plain_decimal_within_range() -> None:
    with pytest.raises(HostfileError, match="SLURM count list '2\\(x99999999999\\)': repeat 99999999999 is more"):
        expand_counts("2(x99999999999)")
    with pytest.raises(HostfileError, match="bad entry"):
        expand_counts("\u0662")


FIB_TRIE = """\
Local:
  +-- 0.0.0.0/0 3 0 5
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 10.1.0.0/24 2 0 2
           |-- 10.1.0.7
              /32 host LOCAL
"""


def test_this_machines_addresses_are_its_interfaces_not_all_of_loopbacks_range(tmp_path: Path) -> None:
    """All of 127/8 binds here, but tests/multihost's namespaces hold 127.200.0.x addresses."""
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "fib_trie").write_text(FIB_TRIE)
    (tmp_path / "net" / "if_inet6").write_text("fd000000000000000000000000000002 04 40 00 82     eth0\n")
    assert interface_addresses(str(tmp_path)) == {"127.0.0.1", "::1", "10.1.0.7", "fd00::2"}


def test_a_name_whose_every_address_is_this_machines_is_local(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = sorted(interface_addresses())
    assert mine and all(is_local_host(address) for address in mine)
    monkeypatch.setattr("launcher.addresses.host_addresses", {"alias": (mine[0],), "half": (mine[0], "198.51.100.7"),
                                                              "ns": ("127.200.0.2",)}.get)
    assert is_local_host("alias") and not is_local_host("half") and not is_local_host("ns")


def test_unknown_hosts_are_those_with_no_address() -> None:
    assert host_addresses("surely-not-this-machine.invalid") == ()
    assert unknown_hosts(["localhost", "surely-not-this-machine.invalid", "127.0.0.1"]) == [
        "surely-not-this-machine.invalid"]
