"""Every layout of a model on a number of ranks, checked, costed and ranked.

The search is a plain enumeration: dp × tp × pp × cp over the divisors of the rank count,
ZeRO stage, micro-batch size (a divisor of each replica's batch), recomputation.  Any of
them can be fixed.  A layout psrt cannot run (TP not dividing the heads, more pipeline
stages than blocks, a batch that does not split) is left out with the reason, and layouts
that do not fit the memory per rank are dropped; when nothing is left,
:class:`NothingFitsError` says why and what would fit (:mod:`psrt.plan.advice`).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

from psrt.errors import ArgumentTypeError, InvalidArgumentError, NothingFitsError
from psrt.plan.cost import StepTime, step_time
from psrt.plan.gpus import resolve as resolve_machine
from psrt.plan.layout import RECOMPUTE, Layout, Precision
from psrt.plan.layout import precision as make_precision
from psrt.plan.machine import Machine, default_machine
from psrt.plan.memory import MemoryBreakdown, in_flight, stage_memory
from psrt.plan.model import Model, ParameterBlocks, stage_key
from psrt.plan.readers import as_model
from psrt.plan.units import parse_bytes
from psrt.pp.partition import balanced_split

AXES = ("dp", "tp", "pp", "cp")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Plan:
    """A layout with what the model predicts for it: the bytes of its fullest rank, each
    pipeline stage's bytes, the blocks each stage holds, and the step time."""

    layout: Layout
    memory: MemoryBreakdown
    stages: tuple[MemoryBreakdown, ...]
    split: tuple[tuple[int, int], ...]  # [start, stop) block indices per pipeline stage
    time: StepTime
    machine: str = ""  # the name of the machine profile the step time comes from


@dataclass(frozen=True)
class Query:
    """What the caller asked the planner, checked; ``fixed`` holds the layout choices it pinned.
    (A transport's pending operation is a :class:`psrt.comm.base.Request`: another thing.)"""

    model: Model
    global_batch: int
    ranks: int
    memory_per_rank: int
    machine: Machine
    precision: Precision
    fixed: tuple[tuple[str, object], ...]
    sequence_parallel: bool

    def pinned(self, name: str) -> object:
        return dict(self.fixed).get(name)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be at least 1, got {value}")
    return value


def make_query(model: object, *, global_batch: object, ranks: object, memory_per_rank: object = None,
               machine: Machine | str | None = None, precision: str = "fp32", optimizer: str = "adam",
               sequence_parallel: bool = True, **fixed: object) -> Query:
    """Check every argument of :func:`layouts` before any search."""
    for name, value in fixed.items():
        if value is None:
            continue
        if name in AXES or name == "micro_batch":
            _positive(name, value)
        elif name == "zero":
            if isinstance(value, bool) or value not in ZERO_STAGES:
                raise InvalidArgumentError(f"zero must be one of 0, 1, 2, 3, got {value!r}")
        elif name == "recompute":
            if value not in RECOMPUTE:
                raise InvalidArgumentError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {value!r}")
        else:
            raise ArgumentTypeError(f"layouts() got an unexpected keyword argument {name!r}")
    if not isinstance(sequence_parallel, bool):
        raise ArgumentTypeError(f"sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
    if machine is None:
        machine = default_machine()
    elif isinstance(machine, str):
        machine = resolve_machine(machine)
    elif not isinstance(machine, Machine):
        raise ArgumentTypeError(f"machine must be a psrt.plan.Machine, a shipped profile's name, a profile's path "
                                f"or None, got {type(machine).__name__}")
    if memory_per_rank is None:
        if not machine.memory_per_rank:
            raise InvalidArgumentError(f"give the memory per rank: the machine profile {machine.name!r} does not say it")
        memory_per_rank = machine.memory_per_rank
    return Query(as_model(model), _positive("global_batch", global_batch), _positive("ranks", ranks),
                   parse_bytes(memory_per_rank), machine, make_precision(precision, optimizer),
                   tuple((k, v) for k, v in sorted(fixed.items()) if v is not None), sequence_parallel)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shape_problem(model: Model, shape: dict[str, int], global_batch: int) -> str | None:
    """Why psrt cannot run the model on this dp × tp × pp × cp shape, or None."""
    blocks = len(model.block_params())
    problems = [model.tp_problem(shape["tp"]), model.cp_problem(shape["cp"])]
    if shape["pp"] > blocks:
        problems.append(f"pp={shape['pp']}: more pipeline stages than the model's {blocks} blocks "
                        f"({model.layers} layers{' with the embedding and the head' if blocks > model.layers else ''})")
    if global_batch % shape["dp"]:
        problems.append(f"dp={shape['dp']} does not divide the global batch of {global_batch}")
    if shape["cp"] > 1 and getattr(model, "dropout", False):
        problems.append(f"cp={shape['cp']}: psrt's ring attention does not support attention dropout")
    return next((p for p in problems if p), None)


def layout_problem(model: Model, layout: Layout, global_batch: int) -> str | None:
    """Why psrt cannot run ``layout``, or None."""
    shape = {axis: getattr(layout, axis) for axis in AXES}
    problem = shape_problem(model, shape, global_batch)
    if problem:
        return problem
    if layout.micro_batch * layout.micro_batches * layout.dp != global_batch:
        return (f"dp={layout.dp} × micro-batch {layout.micro_batch} × {layout.micro_batches} micro-batches "
                f"is not the global batch of {global_batch}")
    if layout.zero >= 2 and layout.pp > 1:
        return (f"zero={layout.zero} with pp={layout.pp}: psrt runs pipelines with ZeRO-1 at most (ZeRO-2/3 "
                "would reduce or gather every stage's parameters once per micro-batch)")
    if layout.recompute != "none" and isinstance(model, ParameterBlocks):
        return "recomputation needs the model's architecture (its activations are not modelled)"
    return None


@functools.lru_cache(maxsize=256)
def _split(model: Model, tp: int, pp: int) -> tuple[tuple[range, tuple], ...]:
    """psrt's own cut of the blocks into pipeline stages (balanced by parameter count), each
    stage with its :func:`stage_key`."""
    return tuple((blocks, stage_key(model, tp, blocks)) for blocks in balanced_split(model.block_params(tp), pp))


def evaluate(model: Model, layout: Layout, *, global_batch: int, machine: Machine, precision: Precision) -> Plan:
    """The bytes per rank and step time of one layout, which must be one psrt can run."""
    problem = layout_problem(model, layout, global_batch)
    if problem:
        raise InvalidArgumentError(f"layout {layout.name} cannot run: {problem}")
    split = _split(model, layout.tp, layout.pp)
    alike: dict[tuple, MemoryBreakdown] = {}  # stages with the same blocks and micro-batches in flight
    stages = []
    for stage, (blocks, key) in enumerate(split):
        key = (key, in_flight(stage, layout))
        if key not in alike:
            alike[key] = stage_memory(model, blocks, stage, layout, precision)
        stages.append(alike[key])
    return Plan(layout, max(stages, key=lambda m: m.total), tuple(stages),
                tuple((blocks.start, blocks.stop) for blocks, _ in split),
                step_time(model, split, layout, precision, machine), machine.name)


def _shapes(query: Query) -> tuple[list[dict[str, int]], list[str]]:
    """dp × tp × pp × cp shapes of the rank count that agree with the pinned axes, and the
    reasons the others were left out."""
    shapes, reasons = [], []
    for tp, pp, cp in itertools.product(_divisors(query.ranks), repeat=3):
        if query.ranks % (tp * pp * cp):
            continue
        shape = {"dp": query.ranks // (tp * pp * cp), "tp": tp, "pp": pp, "cp": cp}
        if any(query.pinned(axis) not in (None, shape[axis]) for axis in AXES):
            continue
        problem = shape_problem(query.model, shape, query.global_batch)
        if problem:
            reasons.append(problem)
        else:
            shapes.append(shape)
    if not shapes and not reasons:
        pinned = {axis: query.pinned(axis) for axis in AXES if query.pinned(axis) is not None}
        product = " × ".join(f"{axis}={value}" for axis, value in pinned.items())
        reasons.append(f"{query.ranks} ranks cannot be laid out as {product} "
                       f"(the product of dp × tp × pp × cp must be the number of ranks)")
    return shapes, list(dict.fromkeys(reasons))


def candidates(query: Query) -> tuple[list[Plan], list[str]]:
    """Every layout psrt can run for the query, costed (whether or not it fits), and the
    reasons the others were left out."""
    shapes, reasons = _shapes(query)
    plans = []
    for shape in shapes:
        replica_batch = query.global_batch // shape["dp"]
        pinned_batch = query.pinned("micro_batch")
        if pinned_batch is not None and replica_batch % pinned_batch:
            reasons.append(f"micro-batch {pinned_batch} does not divide dp={shape['dp']}'s replica batch of "
                           f"{replica_batch}")
            continue
        zeros = [query.pinned("zero")] if query.pinned("zero") is not None else \
            [z for z in ZERO_STAGES if z == 0 or shape["dp"] * shape["cp"] > 1]
        modes = [query.pinned("recompute")] if query.pinned("recompute") is not None else \
            ["none"] if isinstance(query.model, ParameterBlocks) else list(RECOMPUTE)
        for zero, micro_batch, recompute in itertools.product(
                zeros, [pinned_batch] if pinned_batch else _divisors(replica_batch), modes):
            layout = Layout(**shape, zero=zero, micro_batch=micro_batch, micro_batches=replica_batch // micro_batch,
                            recompute=recompute, sequence_parallel=query.sequence_parallel and shape["tp"] > 1)
            problem = layout_problem(query.model, layout, query.global_batch)
            if problem:
                reasons.append(problem)
                continue
            plans.append(evaluate(query.model, layout, global_batch=query.global_batch, machine=query.machine,
                                  precision=query.precision))
    return plans, list(dict.fromkeys(reasons))


def ranked(plans: list[Plan], memory_per_rank: int) -> list[Plan]:
    """The plans that fit, fastest first; step times equal to the 3 significant digits the
    table shows are a tie, which the plan needing fewer bytes per rank wins."""
    fitting = [plan for plan in plans if plan.memory.total <= memory_per_rank]
    return sorted(fitting, key=lambda plan: (float(f"{plan.time.total:.3g}"), plan.memory.total, plan.layout.name))


def layouts(model: object, *, global_batch: int, ranks: int, memory_per_rank: int | str | None = None,
            machine: Machine | str | None = None, precision: str = "fp32", optimizer: str = "adam",
            dp: int | None = None, tp: int | None = None, pp: int | None = None, cp: int | None = 1,
            zero: int | None = None, micro_batch: int | None = None, recompute: str | None = None,
            sequence_parallel: bool = True) -> list[Plan]:
    """The layouts of ``model`` on ``ranks`` ranks that fit ``memory_per_rank`` bytes, fastest first.

    ``model``: a :class:`Transformer`, :class:`ParameterBlocks`, the tiny GPT's ``GPTConfig`` or
    a ``torch.nn.Module`` (as parameter counts).  ``global_batch`` is in sequences (rows) per
    step.  ``machine``: a :class:`Machine`, a shipped profile's name ("a100", "h100", "h200"),
    a profile's path, or None for the labelled default.  ``memory_per_rank`` may be left out
    where the machine says it (the shipped GPU profiles).
    ``precision``: "fp32" (psrt's default) or "bf16"/"fp16" (``ZeroOptimizer(compute_dtype=...)``);
    ``optimizer``: "adam", "sgd-momentum" or "sgd".  ``dp``, ``tp``, ``pp``, ``cp``, ``zero``,
    ``micro_batch`` and ``recompute`` ("none", "selective", "full") pin that choice; None
    searches it (context parallelism is searched only when ``cp=None``).  TP layouts use
    sequence parallelism unless ``sequence_parallel=False``.

    Raises :class:`NothingFitsError` (an ``InvalidArgumentError``) saying why nothing fits and
    what would.
    """
    query = make_query(model, global_batch=global_batch, ranks=ranks, memory_per_rank=memory_per_rank,
                       machine=machine, precision=precision, optimizer=optimizer,
                       sequence_parallel=sequence_parallel, dp=dp, tp=tp, pp=pp, cp=cp, zero=zero,
                       micro_batch=micro_batch, recompute=recompute)
    return search(query)[0]


def search(query: Query) -> tuple[list[Plan], int]:
    """The plans that fit, fastest first, and how many layouts psrt could run; raises
    :class:`NothingFitsError` when none fits."""
    plans, reasons = candidates(query)
    fitting = ranked(plans, query.memory_per_rank)
    if not fitting:
        from psrt.plan.advice import explain
        smallest = min(plans, key=lambda plan: plan.memory.total) if plans else None
        raise NothingFitsError(explain(query, plans, reasons), smallest)
    return fitting, len(plans)


def with_fixed(query: Query, **changes: object) -> Query:
    """The query with some pinned choices changed (None frees one) or other fields replaced."""
    fixed = dict(query.fixed)
    for name in [name for name in changes if name in AXES + ("zero", "micro_batch", "recompute")]:
        value = changes.pop(name)
        if value is None:
            fixed.pop(name, None)
        else:
            fixed[name] = value
    return replace(query, fixed=tuple(sorted(fixed.items())), **changes)
