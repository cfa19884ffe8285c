"""Where each step's time went, read back from a timeline file (``hvd.start_timeline``):
``psrt timeline-summary``, an offline command that runs in one process and needs nothing of
the engine that wrote the file.

The timeline (:mod:`psrt.engine.timeline`) is rank 0's Chrome trace: one row per tensor,
and for each collective of it (an *operation*) the phases NEGOTIATE, WAIT_FOR_OTHER_RANKS,
QUEUE, then the collective itself (ALLREDUCE, BROADCAST, ...) with, when the tensor was
packed into the fusion buffer, MEMCPY_IN_FUSION_BUFFER before it and
MEMCPY_OUT_FUSION_BUFFER after it; CYCLE_START marks each engine cycle if asked for.

Definitions the report relies on:

- A *step* begins at the submission of an operation whose tensor name already has an
  operation in the current step: a training loop reduces each gradient (or bucket) once
  per step, so a name coming back means the next step has begun.  Cycle marks cannot
  serve: a step spans many engine cycles, and the engine runs none while it is idle.
  Step k lasts from its first submission to the next step's (the last step, to the last
  completion), so it includes the compute between its collectives, and the steps
  partition the whole wall time.
- *Where the time went* counts each instant of a step once, in the most advanced phase
  any operation is in then (collective and fusion copies, then queue, then waiting for
  other ranks, then negotiation), and instants with none in *no engine work* (the
  caller's compute, or idle).  These shares add up to 100 % of the wall time.
- *Per tensor* figures are the tensor's own phases summed over its operations: they
  overlap across tensors (tensors fused into one message share its copies and its
  collective), so their shares of the wall time need not add up to 100 %.
"""
from __future__ import annotations

import argparse
import bisect
import json
from dataclasses import dataclass, field

from psrt.errors import TimelineError

#: Phase categories in report order; the trace's phase names map onto them.
CATEGORIES = ("negotiate", "wait", "queue", "copy_in", "collective", "copy_out")
LABELS = {"negotiate": "negotiation", "wait": "waiting for other ranks", "queue": "queue",
          "copy_in": "fusion copy in", "collective": "collective", "copy_out": "fusion copy out",
          "outside": "no engine work (compute, idle)"}
_PHASES = {"NEGOTIATE": "negotiate", "WAIT_FOR_OTHER_RANKS": "wait", "QUEUE": "queue",
           "MEMCPY_IN_FUSION_BUFFER": "copy_in", "MEMCPY_OUT_FUSION_BUFFER": "copy_out"}
#: An instant belongs to the first category active then, in this order (the most advanced).
_PRIORITY = ("collective", "copy_in", "copy_out", "queue", "wait", "negotiate")
_PROCESS_PREFIX = "psrt rank "


@dataclass
class Operation:
    """One collective of one tensor: its phases as (category, start, end), µs from the timeline's start."""

    tensor: str
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    collective: str = ""

    @property
    def submitted(self) -> float:
        return min(start for _, start, _ in self.phases)

    @property
    def end(self) -> float:
        return max(end for _, _, end in self.phases)


@dataclass
class Summary:
    """What a timeline says: times in µs; ``steps[k]`` and ``total`` map each category (and
    ``outside``) to its exclusive time, ``tensors[name]`` to the tensor's own summed phases;
    ``step_cycles`` is None when the timeline has no cycle marks."""

    rank: int
    truncated: bool
    operations: list[Operation]
    step_starts: list[float]
    step_walls: list[float]
    steps: list[dict[str, float]]
    step_ops: list[int]
    step_cycles: list[int] | None
    total: dict[str, float]
    tensors: dict[str, dict[str, float]]
    calls: dict[str, int]
    collectives: dict[str, str]

    @property
    def wall(self) -> float:
        return sum(self.step_walls)


# -- reading a trace, whole or cut short ---------------------------------------------------------------
def read_events(path: str) -> tuple[list[dict], bool]:
    """The trace events in ``path`` and whether the file was cut short (a crash leaves the
    array unterminated, possibly in the middle of its last event, which is then dropped)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise TimelineError(f"{path} is empty: not a psrt timeline (or the job died before writing to it)")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return _read_cut(path, text), True
    events = whole.get("traceEvents") if isinstance(whole, dict) else whole
    if not isinstance(events, list):
        raise TimelineError(f"{path} is JSON but not a Chrome trace: it has no 'traceEvents' list")
    return events, False


def _read_cut(path: str, text: str) -> list[dict]:
    stripped = text.lstrip()
    if stripped.startswith("["):
        pos = len(text) - len(stripped) + 1
    else:
        head = text.find('"traceEvents"')
        pos = text.find("[", head) + 1 if head >= 0 else 0
        if not stripped.startswith("{") or head < 0 or pos == 0:
            raise TimelineError(f"{path} is not a Chrome trace: it is neither JSON nor a trace cut short")
    decoder, events = json.JSONDecoder(), []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return events
        try:
            event, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if "\n" in text[pos:].rstrip():  # more lines follow: damage, not a cut
                raise TimelineError(f"{path}: trace event {len(events)} (line {exc.lineno}) is not valid JSON: "
                                    f"{exc.msg}") from None
            return events  # the last event, cut in the middle
        events.append(event)


# -- operations and steps --------------------------------------------------------------------------------
def operations(path: str, events: list) -> tuple[int, list[Operation], list[float]]:
    """(rank, operations in submission order, cycle marks) of a psrt timeline's events."""
    rank, rows, ops, cycles = None, {}, [], []
    latest: dict[str, Operation] = {}  # each tensor's operation being read (its phases arrive in order)
    for i, event in enumerate(events):
        if not isinstance(event, dict):
            raise TimelineError(f"{path}: trace event {i} is {type(event).__name__}, not an object")
        name, ph = event.get("name"), event.get("ph")
        args = event.get("args") if isinstance(event.get("args"), dict) else {}
        if ph == "M" and name == "process_name":
            label = str(args.get("name", ""))
            if label.startswith(_PROCESS_PREFIX) and label[len(_PROCESS_PREFIX):].isdigit():
                rank = int(label[len(_PROCESS_PREFIX):])
        elif ph == "M" and name == "thread_name":
            rows[event.get("tid")] = str(args.get("name", event.get("tid")))
        elif ph == "i" and name == "CYCLE_START":
            cycles.append(_number(path, i, event, "ts"))
        elif ph == "X":
            start, duration = _number(path, i, event, "ts"), _number(path, i, event, "dur")
            category = _PHASES.get(name, "collective")
            tensor = rows.get(event.get("tid"), str(args.get("tensor", event.get("tid"))))
            op = latest.get(tensor)
            if op is None or name == "NEGOTIATE":
                op = latest[tensor] = Operation(tensor)
                ops.append(op)
            op.phases.append((category, start, start + duration))
            if category == "collective":
                op.collective = str(name)
    if rank is None:
        raise TimelineError(f"{path} is a Chrome trace but not a psrt timeline: no process named "
                            f"'{_PROCESS_PREFIX}N' (psrt writes one first; see hvd.start_timeline)")
    ops.sort(key=lambda op: op.submitted)
    return rank, ops, sorted(cycles)


def _number(path: str, index: int, event: dict, key: str) -> float:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TimelineError(f"{path}: trace event {index} ({event.get('name')!r}) has no numeric {key!r}: {value!r}")
    return float(value)


def step_starts(ops: list[Operation]) -> list[float]:
    """Where each step begins (see the module's definition): a tensor name coming back."""
    starts, seen = [], set()
    for op in ops:
        if not starts or op.tensor in seen:
            starts.append(op.submitted)
            seen = set()
        seen.add(op.tensor)
    return starts


def _exclusive(ops: list[Operation], starts: list[float], end: float) -> list[dict[str, float]]:
    """Each step's time by the most advanced phase active at each instant (a sweep over phase edges)."""
    edges = sorted([(s, 1, c) for op in ops for c, s, _ in op.phases]
                   + [(e, -1, c) for op in ops for c, _, e in op.phases])
    steps = [dict.fromkeys((*CATEGORIES, "outside"), 0.0) for _ in starts]
    active = dict.fromkeys(CATEGORIES, 0)
    points = sorted({*starts, end, *(t for t, _, _ in edges)})
    index = 0
    for here, after in zip(points, points[1:]):  # noqa: RUF007 (Python 3.9 has no itertools.pairwise)
        while index < len(edges) and edges[index][0] <= here:
            _, delta, category = edges[index]
            active[category] += delta
            index += 1
        winner = next((c for c in _PRIORITY if active[c] > 0), "outside")
        steps[bisect.bisect_right(starts, here) - 1][winner] += after - here
    return steps


def summarize(path: str) -> Summary:
    """Read the timeline at ``path`` and account for its time (raises :class:`TimelineError`
    when it is not a psrt timeline, OSError when it cannot be read)."""
    events, truncated = read_events(path)
    rank, ops, cycles = operations(path, events)
    starts = step_starts(ops)
    end = max((op.end for op in ops), default=0.0)
    walls = [after - start for start, after in zip(starts, starts[1:] + [end])]
    steps = _exclusive(ops, starts, end)
    tensors: dict[str, dict[str, float]] = {}
    calls: dict[str, int] = {}
    collectives: dict[str, str] = {}
    for op in ops:
        mine = tensors.setdefault(op.tensor, dict.fromkeys(CATEGORIES, 0.0))
        for category, start, stop in op.phases:
            mine[category] += stop - start
        calls[op.tensor] = calls.get(op.tensor, 0) + 1
        collectives[op.tensor] = collectives.get(op.tensor) or op.collective
    total = {c: sum(step[c] for step in steps) for c in (*CATEGORIES, "outside")}
    step_ops = _count(starts, [op.submitted for op in ops])
    step_cycles = _count(starts, cycles) if cycles else None
    return Summary(rank, truncated, ops, starts, walls, steps, step_ops, step_cycles, total, tensors, calls,
                   collectives)


def _count(starts: list[float], times: list[float]) -> list[int]:
    """How many of ``times`` fall in each step (before the first step: none counted)."""
    counts = [0] * len(starts)
    for t in times:
        k = bisect.bisect_right(starts, t) - 1
        if k >= 0:
            counts[k] += 1
    return counts


# -- the report ---------------------------------------------------------------------------------------
_SHORT = {"negotiate": "negotiate", "wait": "wait", "queue": "queue", "copy_in": "copy in",
          "collective": "collective", "copy_out": "copy out", "outside": "no engine"}


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _name(tensor: str, width: int) -> str:
    return tensor if len(tensor) <= width else "..." + tensor[-(width - 3):]


def render(summary: Summary, path: str, max_rows: int = 20) -> str:
    """The report ``psrt timeline-summary`` prints (times in ms)."""
    s, wall = summary, summary.wall
    lines = [f"psrt timeline-summary: {path} (rank {s.rank}'s view)"]
    if s.truncated:
        lines.append("note: the file was cut short (the job did not stop its timeline); its last operation "
                     "may lack phases")
    if not s.operations:
        lines.append("no collectives recorded: nothing was submitted while the timeline ran")
        return "\n".join(lines)
    cycles = (f"{sum(s.step_cycles)} engine cycles" if s.step_cycles is not None
              else "no cycle marks (start_timeline(path, mark_cycles=True) adds them)")
    lines.append(f"{len(s.step_walls)} steps, {len(s.tensors)} tensors, {len(s.operations)} operations, {cycles}; "
                 f"wall {wall / 1e3:.3f} ms from the first submission to the last completion")
    lines.append("a step begins where a tensor name comes back (each tensor is reduced once per step)")
    lines += ["", "where the time went (each instant counted once, in the most advanced phase then):",
              f"  {'phase':<32}{'ms':>10}{'share':>8}"]
    for category in (*CATEGORIES, "outside"):
        lines.append(f"  {LABELS[category]:<32}{s.total[category] / 1e3:>10.3f}{_share(s.total[category], wall):>8}")
    columns = (*CATEGORIES, "outside")
    marked = s.step_cycles is not None
    lines += ["", "per step (share of the step's wall time):",
              f"  {'step':>4}{'wall ms':>10}{'ops':>5}" + (f"{'cycles':>7}" if marked else "")
              + "".join(f"{_SHORT[c]:>11}" for c in columns)]
    for k, (step, step_wall) in enumerate(zip(s.steps[:max_rows], s.step_walls)):
        cycles = f"{s.step_cycles[k]:>7}" if marked else ""
        lines.append(f"  {k:>4}{step_wall / 1e3:>10.3f}{s.step_ops[k]:>5}" + cycles
                     + "".join(f"{_share(step[c], step_wall):>11}" for c in columns))
    if len(s.steps) > max_rows:
        lines.append(f"  ... and {len(s.steps) - max_rows} more steps")
    latency = {name: sum(phases.values()) for name, phases in s.tensors.items()}
    ranked = sorted(s.tensors, key=lambda name: -latency[name])
    width = min(40, max(6, *(len(name) for name in ranked[:max_rows])))
    lines += ["", "per tensor (its own phases, ms summed over its operations; share = its total / the wall time):",
              f"  {'tensor':<{width}}{'ops':>5}  {'collective':<13}" + "".join(f"{_SHORT[c]:>11}" for c in CATEGORIES)
              + f"{'total':>11}{'share':>8}"]
    for name in ranked[:max_rows]:
        lines.append(f"  {_name(name, width):<{width}}{s.calls[name]:>5}  {s.collectives[name] or '-':<13}"
                     + "".join(f"{s.tensors[name][c] / 1e3:>11.3f}" for c in CATEGORIES)
                     + f"{latency[name] / 1e3:>11.3f}{_share(latency[name], wall):>8}")
    if len(ranked) > max_rows:
        rest = sum(latency[name] for name in ranked[max_rows:])
        lines.append(f"  ... and {len(ranked) - max_rows} more tensors ({rest / 1e3:.3f} ms)")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> None:
    print(render(summarize(args.trace), args.trace, args.max_rows))


def add_command(commands) -> None:
    """Register ``psrt timeline-summary`` on the ``psrt`` command line's subparsers."""
    command = commands.add_parser(
        "timeline-summary", help="where each step's time went (negotiation, waiting for other ranks, queue, "
        "fusion copies, collectives), per tensor and in total, from a file written by hvd.start_timeline",
        description="Print where each step's time went, from a timeline written by hvd.start_timeline (a "
        "file cut short by a crash is read up to its last whole event).  A step begins where a tensor name "
        "comes back; the totals count each instant once, in the most advanced phase any tensor is in, and "
        "add up to the wall time; the per-tensor figures are each tensor's own phases.")
    command.add_argument("trace", metavar="TRACE.json", help="the timeline file (rank 0 writes it)")
    command.add_argument("--max-rows", type=int, default=20, metavar="N",
                         help="show at most N steps and the N tensors that took longest (default 20)")
    command.set_defaults(run=_run)
