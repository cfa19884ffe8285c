"""ASCII timeline of a pipeline step, for logs and for eyeballing a schedule's bubble.

Works on simulated events (unit times) and on measured ones (float seconds) alike.
"""
from __future__ import annotations

import math

from psrt.pp.schedule import Op
from psrt.pp.simulate import Event

_MAX_WIDTH = 160
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _symbol(event: Event) -> str:
    """Forward of micro-batch k: the k-th uppercase letter (wrapping after Z); backward (or its
    input half): lowercase; the weight half of a split backward: '#'."""
    if event.op is Op.BACKWARD_WEIGHT:
        return "#"
    letter = _LETTERS[event.microbatch % len(_LETTERS)]
    return letter if event.op is Op.FORWARD else letter.lower()


def render(events: list[list[Event]], width: int | None = None) -> str:
    """One row per rank (``events[r]`` holds rank r's compute events), time scaled to ``width``
    columns; by default one column per shortest compute, at most 160 columns."""
    flat = [e for row in events for e in row]
    if not flat:
        return "\n".join(f"stage {r} ||" for r in range(len(events)))
    origin = min(e.start for e in flat)
    span = max(e.end for e in flat) - origin
    shortest = min((e.end - e.start for e in flat if e.end > e.start), default=span or 1.0)
    if width is None:
        width = min(_MAX_WIDTH, max(1, math.ceil(span / shortest - 1e-9)))
    scale = width / span if span > 0 else 0.0
    label = len(str(len(events) - 1))
    lines = [f"legend: A-Z forward of micro-batch 0-25 (A = 0), a-z its backward (input half if split), "
             f"'#' a weight half, '.' idle; "
             f"1 column = {span / width:.3g} time units"]
    for r, row_events in enumerate(events):
        row = ["."] * width
        for e in row_events:
            first = min(width - 1, round((e.start - origin) * scale))
            last = max(first + 1, min(width, round((e.end - origin) * scale)))
            row[first:last] = _symbol(e) * (last - first)
        lines.append(f"stage {r:<{label}} |{''.join(row)}|")
    return "\n".join(lines)
