"""Why no layout fits, and what would: the message of :class:`psrt.plan.NothingFitsError`.

It names the smallest layout psrt could run and its bytes, says which part of them
dominates and which knobs divide that part, then tries what the caller could change: each
pinned choice set free, and more ranks (2×, 4×, ... 64×).
"""
from __future__ import annotations

from psrt.plan.model import Transformer
from psrt.plan.search import Plan, Query, candidates, ranked, with_fixed
from psrt.plan.units import format_bytes

_MAX_REASONS = 6
_RANK_FACTORS = (2, 4, 8, 16, 32, 64)


def _layouts(count: int) -> str:
    return "1 layout fits" if count == 1 else f"{count} layouts fit"


def _breakdown(plan: Plan) -> str:
    m = plan.memory
    return (f"parameters {format_bytes(m.params)}, gradients {format_bytes(m.grads)}, optimizer state "
            f"{format_bytes(m.optimizer)}, activations {format_bytes(m.activations)}, buffers {format_bytes(m.buffers)}")


def _dominant(plan: Plan, model_known: bool) -> str:
    m = plan.memory
    if m.activations > m.model_state:
        return ("Activations dominate: full recomputation, smaller micro-batches, TP with sequence parallelism or "
                "context parallelism (cp=None) divide them.")
    advice = "more ranks with ZeRO-3, TP or PP divide it"
    if not model_known:
        advice = "more ranks with ZeRO-3 or PP divide it"
    return f"Parameters, gradients and optimizer state dominate: {advice}."


def _freed(query: Query, need_fit: bool) -> list[str]:
    """What setting each pinned choice free would give."""
    hints = []
    for name, value in query.fixed:
        if name == "cp" and not isinstance(query.model, Transformer):
            continue
        plans, _ = candidates(with_fixed(query, **{name: None}))
        if need_fit:
            fitting = ranked(plans, query.memory_per_rank)
            if fitting:
                hints.append(f"without {name}={value}, {_layouts(len(fitting))}; the fastest is "
                             f"{fitting[0].layout.name} ({format_bytes(fitting[0].memory.total)} per rank)")
        elif plans:
            best = min(plans, key=lambda plan: plan.memory.total)
            hints.append(f"without {name}={value}, layouts such as {best.layout.name} can run")
    return hints


def _more_ranks(query: Query) -> list[str]:
    """The fewest extra ranks (by doubling) with which some layout fits."""
    for factor in _RANK_FACTORS:
        ranks = query.ranks * factor
        plans, _ = candidates(with_fixed(query, dp=None, ranks=ranks))
        fitting = ranked(plans, query.memory_per_rank)
        if fitting:
            smallest = min(fitting, key=lambda plan: plan.memory.total)
            return [(f"with {ranks} ranks, {_layouts(len(fitting))} (the smallest, {smallest.layout.name}, needs "
                     f"{format_bytes(smallest.memory.total)})")]
    return [f"even {query.ranks * _RANK_FACTORS[-1]} ranks leave nothing that fits"]


def explain(query: Query, plans: list[Plan], reasons: list[str]) -> str:
    """The message for a query that left no layout: none could run, or none fits."""
    if not plans:
        shown = "; ".join(reasons[:_MAX_REASONS])
        more = f" (and {len(reasons) - _MAX_REASONS} more)" if len(reasons) > _MAX_REASONS else ""
        lines = [f"no layout of the model on {query.ranks} ranks can run: {shown}{more}."]
        lines += [f"Would run: {hint}." for hint in _freed(query, need_fit=False)]
        return "\n".join(lines)
    smallest = min(plans, key=lambda plan: plan.memory.total)
    which = "the only layout" if len(plans) == 1 else f"the smallest of the {len(plans)} layouts"
    lines = [(f"nothing fits in {format_bytes(query.memory_per_rank)} per rank: {which} psrt can run, "
              f"{smallest.layout.name}, needs {format_bytes(smallest.memory.total)} per rank ({_breakdown(smallest)})."),
             _dominant(smallest, isinstance(query.model, Transformer))]
    lines += [f"Would fit: {hint}." for hint in _freed(query, need_fit=True)]
    lines += [f"Would fit: {hint}." for hint in _more_ranks(query)]
    return "\n".join(lines)
