"""Plans as text: a ranked table for the command line, and one plan in detail."""
from __future__ import annotations

from psrt.plan.search import Plan, Query
from psrt.plan.units import format_bytes

_COLUMNS = ("#", "dp", "tp", "pp", "cp", "zero", "micro-batch", "recompute", "params", "grads", "optimizer",
            "activations", "buffers", "total", "step", "bubble", "comm")


def _row(index: int, plan: Plan) -> list[str]:
    layout, memory, time = plan.layout, plan.memory, plan.time
    tp = f"{layout.tp}+sp" if layout.sequence_parallel and layout.tp > 1 else str(layout.tp)
    return [str(index), str(layout.dp), tp, str(layout.pp), str(layout.cp), str(layout.zero),
            f"{layout.micro_batch} x {layout.micro_batches}", layout.recompute,
            *(format_bytes(value) for value in (memory.params, memory.grads, memory.optimizer, memory.activations,
                                                memory.buffers, memory.total)),
            format_seconds(time.total), f"{time.bubble / time.total:.0%}", f"{time.communication / time.total:.0%}"]


def table(plans: list[Plan], top: int | None = None) -> str:
    """The plans as aligned columns, in the order given (``top``: only the first ones), and the
    machine profile their step times come from.  Bytes are those of each layout's fullest
    rank; ``micro-batch`` is size x count."""
    shown = plans[:top] if top else plans
    rows = [list(_COLUMNS)] + [_row(i, plan) for i, plan in enumerate(shown, start=1)]
    widths = [max(len(row[c]) for row in rows) for c in range(len(_COLUMNS))]
    text = ["  ".join(cell.ljust(width) if _COLUMNS[c] == "recompute" else cell.rjust(width)
                      for c, (cell, width) in enumerate(zip(row, widths))) for row in rows]
    machines = list(dict.fromkeys(plan.machine for plan in shown if plan.machine))
    text += [f"step times from the machine profile: {name}" for name in machines]
    return "\n".join(line.rstrip() for line in text)


def header(query: Query, considered: int, fitting: int) -> str:
    """What was asked, on which machine figures, and how many layouts fit."""
    machine = query.machine.name
    if not query.machine.measured and not query.machine.ranks_per_node:
        machine += "; run `psrt plan --measure` for this machine's figures"
    return "\n".join([
        f"model: {query.model.describe()}",
        (f"{query.ranks} ranks, global batch {query.global_batch}, {format_bytes(query.memory_per_rank)} per "
         f"rank, {query.precision.name}"),
        f"machine: {machine}",
        f"{fitting} of {considered} layouts psrt can run fit; fastest first (modelled step time)",
    ])


def format_seconds(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('ch') else 's'}"


def describe(plan: Plan) -> str:
    """One plan: its layout, the bytes of its first, fullest and last pipeline stages (with the
    blocks each holds) and where the step time goes."""
    layout, time = plan.layout, plan.time
    lines = [(f"layout {layout.name}: {_plural(layout.ranks, 'rank')}, ZeRO-{layout.zero} over "
              f"{_plural(layout.data_ranks, 'data-parallel rank')}, {_plural(layout.micro_batches, 'micro-batch')} of "
              f"{layout.micro_batch}, recompute {layout.recompute}")]
    fullest = max(range(len(plan.stages)), key=lambda s: plan.stages[s].total)
    for stage in sorted({0, fullest, len(plan.stages) - 1}):
        memory, (start, stop) = plan.stages[stage], plan.split[stage]
        lines.append(f"  stage {stage} (blocks {start}-{stop - 1}): params {format_bytes(memory.params)}, grads "
                     f"{format_bytes(memory.grads)}, optimizer {format_bytes(memory.optimizer)}, activations "
                     f"{format_bytes(memory.activations)}, buffers {format_bytes(memory.buffers)}; total "
                     f"{format_bytes(memory.total)}")
    parts = ", ".join(f"{name.replace('_', ' ')} {format_seconds(getattr(time, name))}"
                      for name in ("compute", "bubble", "tp_comm", "cp_comm", "pp_comm", "dp_comm", "optimizer")
                      if getattr(time, name))
    lines.append(f"  step {format_seconds(time.total)}: {parts}")
    return "\n".join(lines)


def code(plan: Plan) -> str:
    """The psrt calls that apply ``plan``'s layout to a ``transformers`` decoder (or a model
    :func:`psrt.tp.parallelize` and :func:`psrt.pp.split` are told the parts of)."""
    layout = plan.layout
    lines = ["# applied to a transformers decoder (model) with psrt:",
             f"grid = ProcessGrid(dp={layout.dp}, tp={layout.tp}, pp={layout.pp})"]
    if layout.cp > 1:
        lines.append("# context parallelism is not applied to transformers models: plan with --cp 1")
    if layout.tp > 1:
        lines.append(f"tp.parallelize(model, grid.tp_set, sequence_parallel={layout.sequence_parallel})")
    module, accumulate = "model", layout.micro_batches
    if layout.pp > 1:
        layers = [sum(1 for index in range(start, stop) if 0 < index < plan.split[-1][1] - 1)
                  for start, stop in plan.split]
        options = f", split={layers}" if all(layers) else ""
        options += ', recompute="full"' if layout.recompute == "full" else ""
        lines += [f"stage = pp.split(model, grid.pp_set{options})",
                  f"pipeline = pp.Pipeline(stage, loss_fn, microbatches={layout.micro_batches})"
                  f"  # {_plural(layout.micro_batch, 'sequence')} each"]
        module = "stage"
    elif accumulate > 1:
        lines.append(f"# {accumulate} micro-batches of {_plural(layout.micro_batch, 'sequence')} per step "
                     "(gradient accumulation)")
    if layout.recompute == "selective":
        lines.append("# selective recomputation needs psrt's own blocks; full recomputation is the nearest here")
    if layout.zero:
        lines.append(f"optimizer = ZeroOptimizer({module}, torch.optim.AdamW, stage={layout.zero}, "
                     "process_set=grid.dp_set, lr=lr)")
    else:
        lines.append(f"optimizer = hvd.DistributedOptimizer(torch.optim.AdamW({module}.parameters(), lr=lr), "
                     f"named_parameters={module}.named_parameters(), process_set=grid.dp_set, "
                     f"backward_passes_per_step={accumulate})")
    return "\n".join(lines)
