"""Check and simulate pipeline schedules without any communication.

Execution model (the real executor's): a SEND never blocks (an isend completed at the
end of the step); a RECV blocks until the peer has executed the matching SEND.
Messages between two ranks in one direction arrive in the order they were sent.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from psrt.errors import InvalidArgumentError, ScheduleError
from psrt.pp.schedule import Action, Op, Schedule, virtual_stage

_SENDS = {Op.SEND_FORWARD: +1, Op.SEND_BACKWARD: -1}
_RECVS = {Op.RECV_FORWARD: -1, Op.RECV_BACKWARD: +1}
_COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
_RELEASES = (Op.BACKWARD, Op.BACKWARD_WEIGHT)  # the last compute of a micro-batch


@dataclass(frozen=True)
class Event:
    """One compute action as it ran (or would run): times in seconds or units from the step start."""

    rank: int
    op: Op
    microbatch: int
    chunk: int
    start: float
    end: float


def _message(rank: int, a: Action, ranks: int) -> tuple[tuple[int, int, str], tuple[int, int]]:
    """(link, message) of a send or receive: link = (sender rank, receiver rank, direction),
    message = (micro-batch, sending virtual stage)."""
    stage = virtual_stage(rank, a.chunk, ranks)
    step = _SENDS.get(a.op) or _RECVS[a.op]
    peer = stage + step
    sender, receiver = (stage, peer) if a.op in _SENDS else (peer, stage)
    direction = "forward" if a.op in (Op.SEND_FORWARD, Op.RECV_FORWARD) else "backward"
    return (sender % ranks, receiver % ranks, direction), (a.microbatch, sender)


def check(schedule: Schedule, microbatches: int, chunks: int = 1) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` runs every micro-batch exactly once per
    virtual stage, in dependency order, with paired messages and without deadlock."""
    if not schedule:
        raise InvalidArgumentError("schedule has no ranks")
    for label, value in (("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{label} must be a positive integer, got {value!r}")
    positions = [_positions(r, actions, microbatches, chunks) for r, actions in enumerate(schedule)]
    for r, pos in enumerate(positions):
        for c in range(chunks):
            for k in range(microbatches):
                _check_order(r, pos, k, c, len(schedule), chunks)
        extra = set(pos) - set(_expected(r, pos, microbatches, chunks, len(schedule)))
        if extra:
            raise ScheduleError(f"rank {r}: unexpected action {min(extra, key=str)}")
    _check_links(schedule)
    simulate(schedule, chunks=chunks)


def _positions(rank: int, actions: list[Action], microbatches: int, chunks: int) -> dict[Action, int]:
    """Index of every action of a rank; rejects out-of-range ids and repeated actions."""
    pos: dict[Action, int] = {}
    for i, a in enumerate(actions):
        if not (0 <= a.microbatch < microbatches and 0 <= a.chunk < chunks):
            raise ScheduleError(f"rank {rank}: action {a} is outside {microbatches} micro-batches x {chunks} chunks")
        if a in pos:
            raise ScheduleError(f"rank {rank}: action {a} runs twice (steps {pos[a]} and {i})")
        pos[a] = i
    return pos


def _split(pos: dict[Action, int], k: int, c: int) -> bool:
    """Whether micro-batch k of chunk c runs its backward split in two (input, then weight)."""
    return Action(Op.BACKWARD_INPUT, k, c) in pos


def _expected(rank: int, pos: dict[Action, int], microbatches: int, chunks: int, ranks: int) -> list[Action]:
    """Every action a rank must run, in no particular order."""
    last = ranks * chunks - 1
    out = []
    for c in range(chunks):
        s = virtual_stage(rank, c, ranks)
        split = {k: _split(pos, k, c) for k in range(microbatches)}
        out += [Action(op, k, c) for k in range(microbatches)
                for op in ((Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT) if split[k]
                           else (Op.FORWARD, Op.BACKWARD))]
        ops = [Op.RECV_FORWARD, Op.SEND_BACKWARD] if s > 0 else []
        ops += [Op.SEND_FORWARD, Op.RECV_BACKWARD] if s < last else []
        out += [Action(op, k, c) for op in ops for k in range(microbatches)]
    return out


def _check_order(rank: int, pos: dict[Action, int], k: int, c: int, ranks: int, chunks: int) -> None:
    """Forward before backward; each receive before the compute that needs it; each send after
    the compute that produced it.  With paired links this orders stage s after stage s-1."""
    stage, last = virtual_stage(rank, c, ranks), ranks * chunks - 1
    f = Action(Op.FORWARD, k, c)
    if _split(pos, k, c):
        b = Action(Op.BACKWARD_INPUT, k, c)
        before = [(f, b), (b, Action(Op.BACKWARD_WEIGHT, k, c))]
        if Action(Op.BACKWARD, k, c) in pos:
            raise ScheduleError(f"rank {rank}: micro-batch {k} (chunk {c}) runs both a whole and a split backward")
    else:
        b = Action(Op.BACKWARD, k, c)
        before = [(f, b)]
    if stage > 0:
        before += [(Action(Op.RECV_FORWARD, k, c), f), (b, Action(Op.SEND_BACKWARD, k, c))]
    if stage < last:
        before += [(f, Action(Op.SEND_FORWARD, k, c)), (Action(Op.RECV_BACKWARD, k, c), b)]
    for first, then in before:
        if first not in pos or then not in pos:
            missing = first if first not in pos else then
            raise ScheduleError(f"rank {rank}: never runs {missing} (micro-batch {k}, chunk {c})")
        if pos[first] > pos[then]:
            raise ScheduleError(f"rank {rank}: {then} at step {pos[then]} runs before {first} at step {pos[first]}")


def _check_links(schedule: Schedule) -> None:
    """Each (sender, receiver, direction) link carries the same messages in the same order on both ends."""
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.op in _SENDS or a.op in _RECVS:
                link, msg = _message(r, a, len(schedule))
                (sent if a.op in _SENDS else received).setdefault(link, []).append((msg, a))
    for link in sorted(set(sent) | set(received)):
        s, rv = sent.get(link, []), received.get(link, [])
        for i in range(max(len(s), len(rv))):
            if i >= len(rv):
                raise ScheduleError(f"rank {link[0]}: {s[i][1]} sends to rank {link[1]}, which never receives it")
            if i >= len(s):
                raise ScheduleError(f"rank {link[1]}: {rv[i][1]} waits for rank {link[0]}, which never sends it")
            if s[i][0] != rv[i][0]:
                raise ScheduleError(
                    f"rank {link[1]}: message {i} on the {link[2]} link from rank {link[0]} is {s[i][1]} "
                    f"there but {rv[i][1]} here; sends and receives are out of order")


def simulate(schedule: Schedule, forward_time: float = 1.0, backward_time: float = 1.0,
             chunks: int = 1, weight_time: float | None = None) -> list[list[Event]]:
    """Run ``schedule`` in the execution model with zero-time communication and fixed compute
    times (per chunk ``forward_time / chunks``); returns each rank's compute events.  A split
    backward takes ``backward_time - weight_time`` for the input gradient and ``weight_time``
    (default half the backward) for the weights."""
    ranks = len(schedule)
    weight_time = backward_time / 2 if weight_time is None else weight_time
    duration = {Op.FORWARD: forward_time / chunks, Op.BACKWARD: backward_time / chunks,
                Op.BACKWARD_INPUT: (backward_time - weight_time) / chunks, Op.BACKWARD_WEIGHT: weight_time / chunks}
    pc, clock = [0] * ranks, [0.0] * ranks
    events: list[list[Event]] = [[] for _ in range(ranks)]
    queues: dict[tuple, deque] = {}
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(schedule):
            while pc[r] < len(actions):
                a = actions[pc[r]]
                if a.op in _COMPUTE:
                    start = clock[r]
                    clock[r] += duration[a.op]
                    events[r].append(Event(r, a.op, a.microbatch, a.chunk, start, clock[r]))
                else:
                    link, msg = _message(r, a, ranks)
                    queue = queues.setdefault(link, deque())
                    if a.op in _SENDS:
                        queue.append((msg, clock[r]))
                    elif not queue:
                        break
                    else:
                        got, at = queue.popleft()
                        if got != msg:
                            raise ScheduleError(f"rank {r}: {a} expects micro-batch/stage {msg}, but got {got}")
                        clock[r] = max(clock[r], at)
                pc[r] += 1
                progress = True
    _raise_if_stuck(schedule, pc)
    return events


def _raise_if_stuck(schedule: Schedule, pc: list[int]) -> None:
    """Name every rank that could not finish and the receive it waits on."""
    stuck = [f"rank {r} at step {i} ({actions[i]})"
             for r, (actions, i) in enumerate(zip(schedule, pc)) if i < len(actions)]
    if stuck:
        raise ScheduleError("deadlock: every unfinished rank waits for a message: " + "; ".join(stuck))


def in_flight(actions: list[Action]) -> int:
    """Most (micro-batch, chunk) pairs whose forward has run and last backward (the whole one,
    or the weight half) has not: the number of activations a rank must hold at once."""
    live: set[tuple[int, int]] = set()
    most = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live.add((a.microbatch, a.chunk))
            most = max(most, len(live))
        elif a.op in _RELEASES:
            live.discard((a.microbatch, a.chunk))
    return most


def makespan(events: list[list[Event]]) -> float:
    """End of the last compute on any rank (times measured from the step start)."""
    return max((e.end for row in events for e in row), default=0.0)


def bubble_fraction(events: list[list[Event]]) -> float:
    """Share of rank-time within [0, makespan] spent idle (events on one rank must not overlap)."""
    span = makespan(events)
    if span <= 0:
        return 0.0
    busy = sum(max(0.0, min(e.end, span) - max(e.start, 0.0)) for row in events for e in row)
    return 1.0 - busy / (len(events) * span)
