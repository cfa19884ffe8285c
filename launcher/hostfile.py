"""Where ranks may run: hostfiles, ``-H`` host lists and SLURM allocations.

Every source of hosts is turned into the same value, a tuple of
:class:`Host`, so that the command builder never needs to know where the
hosts came from. Parsing is strict: a hostfile with a typo should stop the
launch with the file name, line number and line text, not start a job on the
wrong machines.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from launcher.addresses import is_local_host  # here too for launcher.elastic, which reads hosts from here

__all__ = [
    "Host",
    "HostfileError",
    "expand_counts",
    "expand_nodelist",
    "hosts_from_slurm",
    "is_local_host",
    "merge_hosts",
    "parse_count",
    "parse_discovery",
    "parse_hostfile",
    "parse_hosts",
    "total_slots",
]

# The most slots one host may have: far above any machine's cores or GPUs, far below what
# would overflow a C int in the MPI launcher.
MAX_SLOTS = 65536
_DECIMAL = re.compile(r"[0-9]+")
# Open MPI keys that describe capacity limits psrun does not use.
_IGNORED_KEYS = frozenset({"max_slots", "max-slots", "max_count"})
_SLOT_KEYS = frozenset({"slots", "count", "cpu"})


class HostfileError(ValueError):
    """A host list, hostfile or SLURM allocation that cannot be used."""


@dataclass(frozen=True)
class Host:
    """One machine and the number of ranks it may run (its slots)."""

    name: str
    slots: int

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise HostfileError(f"bad host name {self.name!r}")
        if self.slots <= 0:
            raise HostfileError(
                f"host {self.name!r} has {self.slots} slots; slots must be a positive integer"
            )

    def __str__(self) -> str:
        return f"{self.name}:{self.slots}"


def total_slots(hosts: Iterable[Host]) -> int:
    """Number of ranks the hosts can run without oversubscribing."""
    return sum(h.slots for h in hosts)


def parse_count(text: str, what: str, maximum: int) -> int:
    """A count written in plain ASCII decimal digits, from 1 to ``maximum``; ``what`` names
    it in the error (Python's ``int()`` would also take ``1_0``, ``+3``, spaces and other
    scripts' digits, which no MPI reads the same way)."""
    if not _DECIMAL.fullmatch(text):
        if re.fullmatch(r"-[0-9]+", text):
            raise HostfileError(f"{what} {text} must be a positive integer")
        raise HostfileError(f"{what} {text!r} is not an integer in plain decimal digits (0-9)")
    value = int(text)
    if value < 1:
        raise HostfileError(f"{what} {value} must be a positive integer")
    if value > maximum:
        raise HostfileError(f"{what} {value} is more than {maximum}, the most psrun accepts")
    return value


def _slots(text: str, where: str) -> int:
    """A slot count, or an error that names where the bad value was."""
    return parse_count(text, f"{where}: slot count", MAX_SLOTS)


def merge_hosts(hosts: Iterable[Host]) -> tuple[Host, ...]:
    """Sum the slots of repeated hosts, as Open MPI and MPICH do, keeping first-seen order."""
    slots: dict[str, int] = {}
    for h in hosts:
        slots[h.name] = slots.get(h.name, 0) + h.slots
    return tuple(Host(name, n) for name, n in slots.items())


def _host_colon(item: str, where: str) -> Host:
    """Parse ``host`` or ``host:N`` (MPICH / Horovod style)."""
    name, sep, count = item.partition(":")
    if not name or ":" in count:
        raise HostfileError(f"{where}: expected HOST or HOST:SLOTS, got {item!r}")
    return Host(name, _slots(count, where) if sep else 1)


def parse_hosts(spec: str, merge: bool = True) -> tuple[Host, ...]:
    """Parse a ``-H`` value such as ``host1:4,host2:4``; a host without ``:N`` has 1 slot.
    ``merge=False`` keeps a repeated host's entries apart (elastic slot groups)."""
    items = [item.strip() for item in spec.split(",")]
    if not any(items):
        raise HostfileError(f"-H {spec!r}: no hosts given")
    hosts = []
    for item in items:
        if not item:
            raise HostfileError(f"-H {spec!r}: empty host name between commas")
        hosts.append(_host_colon(item, f"-H {spec!r}"))
    return merge_hosts(hosts) if merge else tuple(hosts)


def _parse_line(text: str, where: str) -> Host:
    """One non-blank hostfile line in Open MPI (``host slots=4``) or MPICH (``host:4``) form."""
    # Allow "slots = 4" by gluing the spaces around '=' before splitting.
    fields = re.sub(r"\s*=\s*", "=", text).split()
    first, options = fields[0], fields[1:]
    if "=" in first:
        raise HostfileError(f"{where}: line starts with an option, not a host name")
    if ":" in first:
        if options:
            raise HostfileError(f"{where}: HOST:SLOTS takes no further options")
        return _host_colon(first, where)
    slots = 1
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise HostfileError(f"{where}: expected KEY=VALUE after the host name, got {option!r}")
        if key in _SLOT_KEYS:
            slots = _slots(value, where)
        elif key not in _IGNORED_KEYS:
            raise HostfileError(f"{where}: unknown option {key!r} (use slots=N)")
    return Host(first, slots)


def parse_hostfile(path: str, merge: bool = True) -> tuple[Host, ...]:
    """Read a hostfile in Open MPI or MPICH/Horovod format; see hostfile.example.
    ``merge=False`` keeps a repeated host's lines apart (elastic slot groups)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise HostfileError(f"hostfile {path!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise HostfileError(f"cannot read hostfile {path!r}: {reason}") from None
    hosts = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{path}:{number}: {line.strip()!r}"
        try:
            hosts.append(_parse_line(text, where))
        except HostfileError as e:
            if str(e).startswith(where):
                raise
            raise HostfileError(f"{where}: {e}") from None
    if not hosts:
        raise HostfileError(f"hostfile {path!r} lists no hosts")
    return merge_hosts(hosts) if merge else tuple(hosts)


def parse_discovery(output: str, script: str) -> tuple[Host, ...]:
    """The slot groups a host discovery script printed: one ``HOST`` or ``HOST:SLOTS`` per
    line, as Horovod's ``--host-discovery-script`` takes (blank lines and ``#`` comments
    skipped; an empty list is allowed: no host is usable now)."""
    hosts = []
    for number, line in enumerate(output.splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if text:
            hosts.append(_host_colon(text, f"host discovery script {script!r}, output line {number}"))
    return tuple(hosts)


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _expand_range(item: str, nodelist: str) -> list[str]:
    """``07`` -> [``07``]; ``01-03`` -> [``01``, ``02``, ``03``], padded to the width of the start."""
    low, sep, high = item.partition("-")
    if not _DECIMAL.fullmatch(low) or (sep and not _DECIMAL.fullmatch(high)):
        raise HostfileError(f"SLURM node list {nodelist!r}: bad range {item!r}")
    if not sep:
        return [low]
    if int(high) < int(low):
        raise HostfileError(f"SLURM node list {nodelist!r}: range {item!r} runs backwards")
    return [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]


def _expand_name(pattern: str, nodelist: str) -> list[str]:
    """Expand every ``[...]`` group of one node name, left to right."""
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise HostfileError(f"SLURM node list {nodelist!r}: unbalanced brackets in {pattern!r}")
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    names = []
    for item in match.group(1).split(","):
        for number in _expand_range(item.strip(), nodelist):
            names.extend(head + number + rest for rest in _expand_name(tail, nodelist))
    return names


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM compressed node list: ``node[01-03,07],gpu5`` -> node01..node03, node07, gpu5."""
    names = []
    for part in _split_top_level(nodelist.strip()):
        if not part.strip():
            raise HostfileError(f"SLURM node list {nodelist!r}: empty entry")
        names.extend(_expand_name(part.strip(), nodelist))
    return names


def expand_counts(counts: str) -> list[int]:
    """Expand a SLURM count list: ``2(x3),1`` -> [2, 2, 2, 1]."""
    values = []
    for item in counts.split(","):
        match = re.fullmatch(r"\s*([0-9]+)\s*(?:\(x([0-9]+)\))?\s*", item)
        if match is None:
            raise HostfileError(f"SLURM count list {counts!r}: bad entry {item!r}")
        repeat = parse_count(match.group(2), f"SLURM count list {counts!r}: repeat", MAX_SLOTS) \
            if match.group(2) else 1
        values.extend([parse_count(match.group(1), f"SLURM count list {counts!r}: count", MAX_SLOTS)] * repeat)
    return values


def hosts_from_slurm(env: Mapping[str, str]) -> tuple[Host, ...] | None:
    """Hosts of the SLURM allocation psrun runs in, or None outside one.

    Slots come from SLURM_TASKS_PER_NODE, else SLURM_JOB_CPUS_PER_NODE: the
    first is what the user asked ``sbatch``/``salloc`` for, the second what
    the nodes have.
    """
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    names = expand_nodelist(nodelist)
    source = next((k for k in ("SLURM_TASKS_PER_NODE", "SLURM_JOB_CPUS_PER_NODE") if env.get(k)), None)
    if source is None:
        raise HostfileError(
            "SLURM_JOB_NODELIST is set but neither SLURM_TASKS_PER_NODE nor "
            "SLURM_JOB_CPUS_PER_NODE is; give the hosts with -H or --hostfile"
        )
    counts = expand_counts(env[source])
    if len(counts) != len(names):
        raise HostfileError(
            f"SLURM allocation has {len(names)} nodes ({nodelist}) but {source}={env[source]!r} "
            f"gives {len(counts)} counts"
        )
    try:
        return merge_hosts(Host(n, c) for n, c in zip(names, counts))
    except HostfileError as e:
        raise HostfileError(f"{source}={env[source]!r}: {e}") from None
