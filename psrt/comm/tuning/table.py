"""Which algorithm carries a host allreduce or reduce-scatter of a given size: the tuning
table, plain data that is measured once per machine and MPI and kept as readable JSON.

A table lists, per collective, size bands (``from_bytes`` up to the next band) and the
algorithm of each: ``"mpi"`` (the MPI library's own), ``"ring"`` (psrt's chunked ring, see
:mod:`psrt.comm.ring`) and, for the global set of a job over several hosts,
``"hierarchical"`` (see :mod:`psrt.comm.hierarchical`).  It is keyed by what decides those
timings (the hosts, their CPU, the MPI library, the number of ranks and ranks per host): a
table measured for another key is never used.  :mod:`psrt.comm.tuning.measure` measures tables and
finds or writes their files; this module only describes, chooses, reads and writes them.

Every rank of a communicator must choose the same algorithm for a call (ring on one rank,
MPI on another would deadlock), so a job's table is rank 0's, shared with every rank.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Mapping, Sequence

from psrt.errors import PsrtError

#: 2: bands against MPI start at a size measured where the algorithm clearly won (in 1, half-way
#: below it, where the ring could lose).  Part of a cached file's name, so that a table of another
#: format (another psrt's) is never read in place of this one's, nor overwritten by it.
FORMAT = 2
COLLECTIVES = ("allreduce", "reduce_scatter", "hierarchical_allreduce")
ALGORITHMS = ("mpi", "ring", "hierarchical")
#: Another algorithm replaces MPI's only when it is faster by at least this fraction (in the
#: median over repeats, and faster in three repeats out of four, see clearly_beats): psrt must
#: never be slower than the MPI it sits on, and on a shared 2-core VM repeated measurements of one
#: size moved by more than 3 %.
MARGIN = 0.10
#: The fewest repeats a win over MPI's own is taken from.
WIN_REPEATS = 5


class TuningFileError(PsrtError):
    """A tuning file that cannot be used: unreadable, of another format, or for another job."""


@dataclass(frozen=True)
class Band:
    """Messages of at least ``from_bytes`` (up to the next band's) go by ``algorithm``."""

    from_bytes: int
    algorithm: str


@dataclass(frozen=True)
class TuningKey:
    """What a table was measured for; a table is used only by jobs with an equal key."""

    hosts: tuple[str, ...]  # distinct host names, sorted
    cpu: str
    mpi: str  # first line of MPI_Get_library_version
    ranks: int
    ranks_per_host: tuple[int, ...]  # sorted

    def file_name(self) -> str:
        """A readable, file-system-safe name unique to the key and the table format."""
        digest = hashlib.sha256(json.dumps({**asdict(self), "format": FORMAT}, sort_keys=True).encode()).hexdigest()[:12]
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", self.hosts[0] if self.hosts else "host")[:40]
        more = f"+{len(self.hosts) - 1}" if len(self.hosts) > 1 else ""
        return f"{host}{more}-{self.ranks}ranks-{digest}.json"

    def differences(self, other: TuningKey) -> list[str]:
        return [f"{name} {getattr(other, name)!r} (this job: {getattr(self, name)!r})"
                for name in ("hosts", "cpu", "mpi", "ranks", "ranks_per_host")
                if getattr(self, name) != getattr(other, name)]


@dataclass(frozen=True)
class TuningTable:
    """Per collective, the bands that say which algorithm carries a message of each size.

    ``measurements`` keeps what the bands were chosen from (seconds per size and algorithm),
    so that a reader of the file can see why."""

    key: TuningKey | None  # None: a fixed table, made without measuring (see fixed_table)
    allreduce: tuple[Band, ...]
    reduce_scatter: tuple[Band, ...] = (Band(0, "mpi"),)
    hierarchical_allreduce: tuple[Band, ...] = ()  # only for jobs over several hosts
    measured: str = ""  # when, or how the table came about
    measurements: Mapping[str, list] = field(default_factory=dict)

    def algorithm(self, collective: str, nbytes: int) -> str:
        """The algorithm of ``collective`` for a message of ``nbytes``."""
        return _Bands(getattr(self, collective)).algorithm(nbytes)

    def to_json(self) -> str:
        data = {"format": FORMAT, "key": None if self.key is None else asdict(self.key), "measured": self.measured}
        for collective in COLLECTIVES:
            data[collective] = [asdict(band) for band in getattr(self, collective)]
        data["measurements"] = dict(self.measurements)
        return json.dumps(data, indent=1)

    @staticmethod
    def from_json(text: str, source: str = "the tuning file") -> TuningTable:
        """Parse a table, raising :class:`TuningFileError` that names ``source`` and what is
        wrong with it."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TuningFileError(f"{source} is not JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise TuningFileError(f"{source} is not a psrt tuning table of format {FORMAT} (format: {found!r})")
        try:
            key = data["key"]
            key = None if key is None else TuningKey(tuple(key["hosts"]), str(key["cpu"]), str(key["mpi"]),
                                                     int(key["ranks"]), tuple(key["ranks_per_host"]))
            bands = {c: tuple(Band(int(b["from_bytes"]), str(b["algorithm"])) for b in data.get(c, ()))
                     for c in COLLECTIVES}
        except (KeyError, TypeError, ValueError) as exc:
            raise TuningFileError(f"{source} is malformed: {type(exc).__name__} {exc}") from None
        for collective, listed in bands.items():
            _check_bands(collective, listed, source)
        if not bands["allreduce"]:
            raise TuningFileError(f"{source} has no allreduce bands")
        return TuningTable(key, bands["allreduce"], bands["reduce_scatter"] or (Band(0, "mpi"),),
                           bands["hierarchical_allreduce"], str(data.get("measured", "")),
                           dict(data.get("measurements", {})))


def _check_bands(collective: str, bands: Sequence[Band], source: str) -> None:
    starts = [band.from_bytes for band in bands]
    if bands and starts[0] != 0:
        raise TuningFileError(f"{source}: the first {collective} band must start at 0 bytes, not {starts[0]}")
    if starts != sorted(set(starts)):
        raise TuningFileError(f"{source}: {collective} bands must start at increasing sizes, got {starts}")
    allowed = ALGORITHMS if collective == "hierarchical_allreduce" else ALGORITHMS[:2]
    unknown = [band.algorithm for band in bands if band.algorithm not in allowed]
    if unknown:
        raise TuningFileError(f"{source}: unknown {collective} algorithm {unknown[0]!r} (choose from "
                              f"{', '.join(allowed)})")


def fixed_table(ring_threshold: int, key: TuningKey | None = None) -> TuningTable:
    """The table of a fixed threshold (``PSRT_TUNE=off``): MPI below ``ring_threshold``, the
    ring from it, for both collectives."""
    bands = (Band(0, "mpi"), Band(ring_threshold, "ring"))
    return TuningTable(key, bands, bands, measured=f"fixed: PSRT_RING_THRESHOLD={ring_threshold}")


def choose_bands(ratios: Mapping[int, Mapping[str, Sequence[float]]], default: str = "mpi",
                 margin: float = MARGIN) -> tuple[Band, ...]:
    """Bands from ``ratios[size][algorithm]``, each repeat's time of the algorithm over
    ``default``'s (see :func:`ratios`).  ``default`` (MPI's own) carries every size unless
    another algorithm :func:`clearly_beats` it where measured, so that an algorithm chosen
    against MPI never loses to it at a size measured:

    - a band of another algorithm starts at the smallest size measured where it clearly won
      (not half-way below it: no size under the first win is taken on trust), and runs up
      to half-way (in log scale) to the next size measured where it did not;
    - a win at a lone size measured, between sizes where it did not win, is taken for noise
      (the ring's advantage grows with the size), unless it is the largest size measured;
    - below the smallest size measured, ``default``.  Adjacent bands of one algorithm merge."""
    sizes = sorted(ratios)
    winners = []
    for size in sizes:
        clear = {name: median(r) for name, r in ratios[size].items() if name != default and clearly_beats(r, margin)}
        winners.append(min(clear, key=clear.get) if clear else default)
    for i, winner in enumerate(list(winners)):
        alone = (i == 0 or winners[i - 1] != winner) and i + 1 < len(winners) and winners[i + 1] != winner
        if winner != default and alone:
            winners[i] = default
    bands = [Band(0, default)]
    for i, (size, winner) in enumerate(zip(sizes, winners)):
        if winner == bands[-1].algorithm:
            continue
        after_default = bands[-1].algorithm == default
        start = size if i == 0 or (after_default and winner != default) else int(math.sqrt(sizes[i - 1] * size))
        bands.append(Band(start, winner))
    return tuple(bands)


def beyond_measured(bands: tuple[Band, ...], unmeasured_from: int | None, ring_threshold: int) -> tuple[Band, ...]:
    """``bands``, chosen from sizes measured below ``unmeasured_from`` (None: none was left
    out), completed above it as the fixed threshold's table would (the ring from
    ``ring_threshold``, see :func:`fixed_table`) where MPI carries the largest size measured.
    Where the ring does, it goes on above: its advantage over MPI only grows with the size."""
    if unmeasured_from is None or bands[-1].algorithm != "mpi":
        return bands
    return (*bands, Band(max(ring_threshold, unmeasured_from), "ring"))


def clearly_beats(ratios: Sequence[float], margin: float = MARGIN) -> bool:
    """Whether an algorithm whose time over MPI's was ``ratios`` (one per repeat) clearly
    beats MPI: over at least :data:`WIN_REPEATS` repeats, by at least ``margin`` in the
    median, and in three repeats out of four."""
    if len(ratios) < WIN_REPEATS:
        return False
    ordered = sorted(ratios)
    return median(ordered) <= 1 - margin and ordered[math.ceil(0.75 * (len(ordered) - 1))] < 1.0


def medians(samples: Mapping[int, Mapping[str, Sequence[float]]]) -> dict[int, dict[str, float]]:
    """Per size and algorithm, the median of the calls' seconds."""
    return {size: {name: median(times) for name, times in by_name.items()} for size, by_name in samples.items()}


def ratios(samples: Mapping[int, Mapping[str, Sequence[float]]], default: str = "mpi") -> dict[int, dict[str, list[float]]]:
    """Per size and algorithm, each repeat's time over ``default``'s in the same repeat: the
    algorithms of a repeat ran back to back, so a shared machine's slow phases (seconds
    long) cancel out of each ratio, where they would move a median of times."""
    return {size: {name: [t / max(base, 1e-12) for t, base in zip(times, by_name[default])]
                   for name, times in by_name.items()} for size, by_name in samples.items()}


def default_path(key: TuningKey, tune_file: str = "", env: Mapping[str, str] | None = None) -> Path:
    """Where a job with ``key`` keeps its table: ``tune_file`` (``PSRT_TUNE_FILE``) if set, else
    ``$XDG_CACHE_HOME/psrt/tuning/<key>.json`` (``~/.cache`` without XDG_CACHE_HOME)."""
    env = os.environ if env is None else env
    if tune_file:
        return Path(tune_file).expanduser()
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "psrt" / "tuning" / key.file_name()


def read(path: Path, key: TuningKey) -> TuningTable:
    """The table in ``path`` for a job of ``key``; :class:`TuningFileError` (saying why) if
    it cannot be read or was measured for another key."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TuningFileError(f"cannot read the tuning file {path}: {exc.strerror or exc}") from None
    table = TuningTable.from_json(text, f"the tuning file {path}")
    if table.key != key:
        raise TuningFileError(f"the tuning file {path} was measured for another job: "
                              + "; ".join(key.differences(table.key)))
    return table


def write(path: Path, table: TuningTable) -> None:
    """Write ``table`` to ``path`` whole or not at all (a temporary file renamed over it), so
    that jobs writing at once never leave a torn file: the last rename wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(table.to_json() + "\n")
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


class Choice:
    """The table in force for communicators over one group of ranks (a communicator and its
    same-sized splits share one), its bands read once per collective: a call's choice is a
    comparison with the smallest size at which anything but MPI may be chosen, and a
    bisection above it."""

    __slots__ = ("table", "_bands")

    def __init__(self, table: TuningTable) -> None:
        self.use(table)

    def use(self, table: TuningTable) -> None:
        """Switch to ``table``: before any collective uses the communicators, on every rank alike."""
        self.table = table
        self._bands = {collective: _Bands(getattr(table, collective)) for collective in COLLECTIVES}

    def allreduce(self, nbytes: int) -> str:
        return self._bands["allreduce"].algorithm(nbytes)

    def reduce_scatter(self, nbytes: int) -> str:
        return self._bands["reduce_scatter"].algorithm(nbytes)

    def hierarchical(self, nbytes: int) -> bool:
        """Whether the global set's allreduce of ``nbytes`` goes in three steps across hosts."""
        return self._bands["hierarchical_allreduce"].algorithm(nbytes) == "hierarchical"


class _Bands:
    """One collective's bands, as a call looks them up."""

    __slots__ = ("starts", "algorithms", "first_other")

    def __init__(self, bands: Sequence[Band]) -> None:
        self.starts = [band.from_bytes for band in bands]
        self.algorithms = [band.algorithm for band in bands]
        self.first_other = min((band.from_bytes for band in bands if band.algorithm != "mpi"), default=math.inf)

    def algorithm(self, nbytes: int) -> str:
        if nbytes < self.first_other:
            return "mpi"
        return self.algorithms[max(bisect.bisect_right(self.starts, nbytes) - 1, 0)]
