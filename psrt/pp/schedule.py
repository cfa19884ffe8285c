"""Pipeline-parallel schedules as plain values.

A schedule is a list with one entry per pipeline rank; entry ``r`` is the ordered
list of :class:`Action` that rank ``r`` executes in one training step.  Building
the schedule is separate from executing it, so it can be checked and simulated
(:mod:`psrt.pp.simulate`) without any communication.

Vocabulary: a *rank* is a pipeline rank (0 = first); a *chunk* is one of the
model pieces a rank holds; a *virtual stage* ``s = chunk * ranks + rank`` is the
position of that piece in the model (Megatron layout).  Without interleaving
every rank holds one chunk and the virtual stage is the rank.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from psrt.errors import InvalidArgumentError


class Op(enum.Enum):
    """What one step of a rank does; the value is the short name used in messages.

    ``BACKWARD`` is a whole backward.  Zero-bubble schedules split it in two:
    ``BACKWARD_INPUT`` (the gradient of the stage's input, which the previous stage waits
    for) and ``BACKWARD_WEIGHT`` (the parameters' gradients, which nobody waits for and
    can fill a bubble later)."""

    RECV_FORWARD = "RF"
    FORWARD = "F"
    SEND_FORWARD = "SF"
    RECV_BACKWARD = "RB"
    BACKWARD = "B"
    BACKWARD_INPUT = "BI"
    BACKWARD_WEIGHT = "W"
    SEND_BACKWARD = "SB"


@dataclass(frozen=True)
class Action:
    """One step of a rank: ``op`` applied to ``microbatch`` of local model ``chunk``.

    For a send or receive, ``chunk`` is the chunk of the local compute the message
    belongs to; the peer is the previous or next virtual stage.
    """

    op: Op
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        suffix = f".{self.chunk}" if self.chunk else ""
        return f"{self.op.value}{self.microbatch}{suffix}"


Schedule = list[list[Action]]


def virtual_stage(rank: int, chunk: int, ranks: int) -> int:
    """Position in the model of ``chunk`` on ``rank`` (rank r holds stages r, r+p, r+2p, ...)."""
    return chunk * ranks + rank


def _forward(k: int, chunk: int, stage: int, last: int) -> list[Action]:
    """A forward with the receive of its input and the send of its output."""
    actions = [Action(Op.FORWARD, k, chunk)]
    if stage > 0:
        actions.insert(0, Action(Op.RECV_FORWARD, k, chunk))
    if stage < last:
        actions.append(Action(Op.SEND_FORWARD, k, chunk))
    return actions


def _backward(k: int, chunk: int, stage: int, last: int, op: Op = Op.BACKWARD) -> list[Action]:
    """A backward (or its input half) with the receive of its output gradient and the send
    of its input gradient."""
    actions = [Action(op, k, chunk)]
    if stage < last:
        actions.insert(0, Action(Op.RECV_BACKWARD, k, chunk))
    if stage > 0:
        actions.append(Action(Op.SEND_BACKWARD, k, chunk))
    return actions


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards (GPipe / AFAB): every rank holds all m activations."""
    _check_counts(stages, microbatches, 1)
    last = stages - 1
    schedule = []
    for r in range(stages):
        actions = [a for k in range(microbatches) for a in _forward(k, 0, r, last)]
        actions += [a for k in range(microbatches) for a in _backward(k, 0, r, last)]
        schedule.append(actions)
    return schedule


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """PipeDream-flush 1F1B: same bubble as GPipe, but rank r holds at most p - r activations."""
    _check_counts(stages, microbatches, 1)
    last = stages - 1
    schedule = []
    for r in range(stages):
        warmup = min(stages - r - 1, microbatches)
        # Warm-up: forwards only, to fill the pipeline below this rank.
        actions = [a for k in range(warmup) for a in _forward(k, 0, r, last)]
        # Steady state: one forward, one backward.
        for k in range(microbatches - warmup):
            actions += _forward(k + warmup, 0, r, last) + _backward(k, 0, r, last)
        # Cool-down: the backwards of the warm-up forwards.
        for k in range(microbatches - warmup, microbatches):
            actions += _backward(k, 0, r, last)
        schedule.append(actions)
    return schedule


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B's order of forwards
    and input-gradient backwards, with each weight-gradient backward split off and deferred.

    Rank r defers its first r weight passes, so the input gradients travel up the pipeline
    without waiting for them, and the deferred ones fill the cool-down's idle time.  A rank
    holds at most p micro-batches (from forward to weight pass), the most any 1F1B rank
    holds (rank 0), and with equal forward, input- and weight-backward times the bubble
    is a third of 1F1B's: (p − 1)/(3m + p − 1) of the step.  The messages, and so the
    deadlock-freedom the checker proves, are 1F1B's."""
    _check_counts(stages, microbatches, 1)
    last = stages - 1
    schedule = []
    for r in range(stages):
        warmup = min(stages - r - 1, microbatches)
        deferred: list[int] = []  # micro-batches whose weight pass is still to run

        def backward(k: int) -> list[Action]:
            deferred.append(k)
            actions = _backward(k, 0, r, last, Op.BACKWARD_INPUT)
            if len(deferred) > r:  # keep r weight passes back for the cool-down
                actions.append(Action(Op.BACKWARD_WEIGHT, deferred.pop(0)))
            return actions

        actions = [a for k in range(warmup) for a in _forward(k, 0, r, last)]
        for k in range(microbatches - warmup):
            actions += _forward(k + warmup, 0, r, last) + backward(k)
        for k in range(microbatches - warmup, microbatches):
            actions += backward(k)
        actions += [Action(Op.BACKWARD_WEIGHT, k) for k in deferred]
        schedule.append(actions)
    return schedule


def interleaved_one_f_one_b(stages: int, microbatches: int, chunks: int) -> Schedule:
    """Megatron's interleaved 1F1B: each rank holds ``chunks`` model chunks, which divides the
    bubble by ``chunks`` at the cost of more messages.  ``microbatches`` must be a multiple of
    ``stages``; with one chunk this is plain :func:`one_f_one_b`."""
    _check_counts(stages, microbatches, chunks)
    if chunks == 1:
        return one_f_one_b(stages, microbatches)
    if microbatches % stages:
        raise InvalidArgumentError(
            f"interleaved schedule needs micro-batches ({microbatches}) to be a multiple of "
            f"pipeline stages ({stages})")
    total, last = microbatches * chunks, stages * chunks - 1

    def fwd(r: int, i: int) -> list[Action]:
        k, c = _interleaved_ids(i, stages, chunks, forward=True)
        return _forward(k, c, virtual_stage(r, c, stages), last)

    def bwd(r: int, i: int) -> list[Action]:
        k, c = _interleaved_ids(i, stages, chunks, forward=False)
        return _backward(k, c, virtual_stage(r, c, stages), last)

    schedule = []
    for r in range(stages):
        warmup = min((stages - r - 1) * 2 + (chunks - 1) * stages, total)
        # Warm-up: forwards only.
        actions = [a for i in range(warmup) for a in fwd(r, i)]
        # Steady state: one forward, one backward.
        for i in range(total - warmup):
            actions += fwd(r, i + warmup) + bwd(r, i)
        # Cool-down: the remaining backwards.
        for i in range(total - warmup, total):
            actions += bwd(r, i)
        schedule.append(actions)
    return schedule


def _interleaved_ids(i: int, stages: int, chunks: int, forward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of the i-th forward or backward: groups of ``stages`` micro-batches
    go through chunk 0, 1, ... (forward) or chunk v-1, v-2, ... (backward)."""
    group, within = divmod(i, stages * chunks)
    chunk = within // stages
    if not forward:
        chunk = chunks - chunk - 1
    return group * stages + i % stages, chunk


_BUILDERS = {"gpipe": "gpipe", "afab": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved",
             "zb-h1": "zb-h1", "zbh1": "zb-h1"}


def build(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The schedule called ``name`` ("gpipe"/"afab", "1f1b", "interleaved" or "zb-h1"), for
    the configuration-driven caller; ``chunks`` > 1 is only meaningful for "interleaved"."""
    kind = _BUILDERS.get(name.lower()) if isinstance(name, str) else None
    if kind is None:
        raise InvalidArgumentError(
            f"unknown pipeline schedule {name!r}; choose one of {', '.join(sorted(_BUILDERS))}")
    _check_counts(stages, microbatches, chunks)
    if kind == "interleaved":
        return interleaved_one_f_one_b(stages, microbatches, chunks)
    if chunks != 1:
        raise InvalidArgumentError(f"chunks={chunks} needs the 'interleaved' schedule, not {name!r}")
    if kind == "zb-h1":
        return zero_bubble_h1(stages, microbatches)
    return gpipe(stages, microbatches) if kind == "gpipe" else one_f_one_b(stages, microbatches)


def _check_counts(stages: object, microbatches: object, chunks: object) -> None:
    """Reject non-integer or non-positive sizes with a message naming the argument."""
    for label, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{label} must be a positive integer, got {value!r}")
