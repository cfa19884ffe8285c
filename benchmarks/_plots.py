"""The figures the benchmarks draw beside their tables, into ``benchmarks/plots/``.

One function per kind of figure, each taking plain numbers (and, for the pipeline, the
events ``psrt.pp`` already produces), so a benchmark adds a call on rank 0 and nothing
else.  Every figure's title names the machine and the date, since absolute figures move
from machine to machine and from run to run.  A figure that spans several runs (one per
rank count) keeps the runs' numbers in a JSON file beside it (:func:`remember`), and is
redrawn from all of them by each run.
"""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node
import matplotlib.pyplot as plt
import torch
from _sizes import fmt_size
from PIL import Image

PLOTS = Path(__file__).resolve().parent / "plots"
_COLORS = {"psrt": "C0", "mpi4py": "C1", "gloo": "C2", "ddp": "C2"}
_BUSBW_LABELS = {"psrt": "psrt hvd.allreduce_", "psrt_transport": "psrt transport alone (no engine)",
                 "mpi4py": "mpi4py Allreduce on numpy", "gloo": "torch.distributed over gloo"}
_PIPELINE_COLORS = {"FORWARD": "#4c72b0", "BACKWARD": "#dd8452", "BACKWARD_INPUT": "#dd8452",
                    "BACKWARD_WEIGHT": "#55a868"}
_PIPELINE_LABELS = {"FORWARD": "forward", "BACKWARD": "backward (input half if split)",
                    "BACKWARD_WEIGHT": "weight half of a split backward"}


def machine() -> str:
    """What the figures were measured on, as a title line says it."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPU cores, {gpu}"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _save(fig, name: str, title: str, bottom: float = 0.0) -> Path:
    """Title with machine and date, laid out above the axes (``bottom``: the figure's share
    kept free below them for a note), then ``plots/name``; returns the path written."""
    fig.suptitle(f"{title}\n{machine()}, {_now()}", fontsize=11)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    PLOTS.mkdir(exist_ok=True)
    path = PLOTS / name
    drawn = io.BytesIO()
    fig.savefig(drawn, format="png", dpi=90)
    plt.close(fig)
    # A few dozen flat colours: an indexed PNG is a third of the size, so the repository stays small.
    Image.open(drawn).convert("RGB").quantize(colors=64).save(path, optimize=True)
    return path


def remember(figure: str, key: str, record: dict) -> dict[str, dict]:
    """Keep ``record`` (with the time it was taken) as run ``key`` of ``figure`` in
    ``plots/<figure>.json``, replacing an earlier run of that key; returns every run kept."""
    path = PLOTS / f"{figure}.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[key] = {**record, "taken": _now()}
    PLOTS.mkdir(exist_ok=True)
    path.write_text(json.dumps(runs, indent=1) + "\n")
    return runs


def allreduce_busbw(sizes: list[int], busbw: dict[str, list[float]], ranks: int,
                    ceiling: float | None = None, note: str = "") -> Path:
    """Bus bandwidth (GB/s) against message size, one line per implementation; ``ceiling``
    is the memory-copy bound of a ring on this machine, where the benchmark knows one;
    ``note`` says how the figures were taken."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, values in busbw.items():
        transport = name == "psrt_transport"
        ax.plot(sizes, values, marker="o", ms=4, color=_COLORS.get(name, "C0" if transport else None),
                ls="--" if transport else "-", alpha=0.6 if transport else 1.0,
                label=_BUSBW_LABELS.get(name, name))
    if ceiling is not None:
        ax.axhline(ceiling, color="grey", ls=":",
                   label=f"ring's memory-copy ceiling, large messages ({ceiling:.2f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes, [fmt_size(s) for s in sizes])
    ax.set_xlabel("message size (bytes, float32)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=9, loc="best")
    fig.text(0.01, 0.01, note, fontsize=7)
    return _save(fig, "allreduce_busbw.png", f"allreduce bus bandwidth, {ranks} ranks (higher is better)",
                 bottom=0.04 if note else 0.0)


def dp_scaling(runs: dict[str, dict]) -> Path:
    """Training throughput against ranks, one panel per model.  ``runs[str(n)][model]`` holds
    samples/s of ``single`` (one process alone), ``no_comm`` (n ranks computing without
    communicating), ``psrt`` and ``ddp`` at n ranks; the 1-rank point is ``single``.  Rank
    counts above this machine's cores are shaded as oversubscribed."""
    cores = os.cpu_count() or 1
    counts = sorted(int(n) for n in runs)
    models = list(runs[str(counts[0])]["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        figures = [runs[str(n)]["models"][model] for n in counts]
        single = sorted(f["single"] for f in figures)[len(figures) // 2]
        ranks = [1] + counts
        ax.plot(ranks, [single * n for n in ranks], color="grey", ls=":", label="ideal (ranks x one process)")
        ax.plot(ranks, [single] + [f["no_comm"] for f in figures], color="grey", ls="--", marker=".",
                label="no communication (machine's ceiling)")
        for impl, label in (("psrt", "psrt DistributedOptimizer"), ("ddp", "torch DDP over gloo")):
            ax.plot(ranks, [single] + [f[impl] for f in figures], marker="o", color=_COLORS[impl], label=label)
        if counts[-1] > cores:
            ax.axvspan(cores + 0.5, counts[-1] + 0.5, color="red", alpha=0.07)
        ax.set_xticks(ranks, [f"{n}\n(oversubscribed:\n{cores} cores)" if n > cores else str(n) for n in ranks])
        ax.set_xlim(0.5, counts[-1] + 0.5)
        ax.set_xlabel("ranks")
        ax.set_ylabel("samples / s (all ranks)")
        ax.set_title(f"{model}, batch {runs[str(counts[0])]['batch_per_rank']} per rank", fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper left")
    taken = ", ".join(f"{n} ranks {runs[str(n)]['taken']}" for n in counts)
    fig.text(0.01, 0.01, f"1 rank = one process alone (median of the runs); runs: {taken}", fontsize=7)
    return _save(fig, "dp_scaling.png", "data-parallel training throughput against ranks", bottom=0.03)


def zero_memory(runs: dict[str, dict]) -> Path:
    """Measured bytes per rank (stacked: parameters, gradients, optimizer state) for each
    mode, with ZeRO's formula as a line; one panel per run (``runs[key]["modes"][mode]``
    holds ``bytes`` and ``formula``, dicts of params/grads/optimizer)."""
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.8), squeeze=False, sharey=True)
    parts = (("params", "parameters"), ("grads", "gradients"), ("optimizer", "optimizer state"))
    for ax, key in zip(axes[0], sorted(runs, key=lambda k: (runs[k]["ranks"], k))):
        modes = runs[key]["modes"]
        names = list(modes)
        ticks = ["DP" if m == "dp" else f"ZeRO-{m[-1]}" for m in names]
        bottom = [0.0] * len(names)
        for (part, label), color in zip(parts, ("C0", "C1", "C2")):
            heights = [modes[m]["bytes"][part] / 1e6 for m in names]
            ax.bar(ticks, heights, bottom=bottom, color=color, label=label, width=0.6)
            bottom = [b + h for b, h in zip(bottom, heights)]
        for x, total in enumerate(bottom):
            ax.text(x, total + 2, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
        formula = [sum(modes[m]["formula"].values()) / 1e6 for m in names]
        ax.plot(ticks, formula, color="black", marker="_", ms=22, mew=2, ls=":", label="ZeRO formula (total)")
        ax.set_title(f"{runs[key]['ranks']} ranks, {runs[key]['params'] / 1e6:.1f} M parameters, "
                     f"{runs[key]['compute']} (run {runs[key]['taken']})", fontsize=9)
        ax.set_xlabel("mode")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("MB per rank (measured)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    axes[0][0].legend(handles[::-1], labels[::-1], fontsize=8)
    fig.text(0.01, 0.01, "DP = hvd.DistributedOptimizer; ZeRO-k = ZeroOptimizer(stage=k); bars: bytes held after a "
             "backward in the second step\nformula: the ZeRO paper's bytes per element "
             "(fp32 Adam: 4 + 4 + 8; bf16 compute with fp32 masters: 2 + 2 + 12)", fontsize=7)
    return _save(fig, "zero_memory.png", "ZeRO: bytes per rank by stage, Adam", bottom=0.07)


def pipeline_timeline(panels: dict[str, tuple[list, list]], microbatches: int, note: str) -> Path:
    """One panel per schedule: each rank's measured compute events (``psrt.pp`` events,
    seconds from the rank's own step start) above its simulated ones, whose time unit is
    scaled to the measured mean forward so the two are comparable."""
    first = next(iter(panels.values()))[0]
    p = len(first)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 0.55 * 2 * p * len(panels) + 1.6), sharex=True,
                             squeeze=False)
    for ax, (schedule, (measured, simulated)) in zip(axes[:, 0], panels.items()):
        forwards = [e.end - e.start for row in measured for e in row if e.op.name == "FORWARD"]
        unit = sum(forwards) / len(forwards)
        labels = []
        for r in range(p):
            _gantt(ax, 2 * r, measured[r], 1.0, alpha=1.0)
            _gantt(ax, 2 * r + 1, simulated[r], unit, alpha=0.45)
            labels += [f"rank {r} measured", f"rank {r} simulated"]
        ax.set_yticks(range(2 * p), labels, fontsize=8)
        ax.set_ylim(2 * p - 0.5, -0.5)
        ax.set_title(f"{schedule}, p = {p}, m = {microbatches}", fontsize=10, loc="left")
        ax.grid(True, axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from each rank's own step start (simulated: 1 unit = the measured mean forward)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=_PIPELINE_COLORS[op], label=label)
               for op, label in _PIPELINE_LABELS.items()]
    fig.legend(handles=handles, fontsize=8, loc="lower right", ncol=3)
    if "zb-h1" in panels:
        note += "\nZB-H1: the first stage's backward stays whole (its input needs no gradient)"
    fig.text(0.01, 0.012, note, fontsize=8)
    return _save(fig, "pipeline_timeline.png", "pipeline schedules: measured against simulated, one step",
                 bottom=0.035)


def _gantt(ax, row: int, events: list, unit: float, alpha: float) -> None:
    """One row of boxes, each labelled with its micro-batch where it is wide enough."""
    span = max((e.end for e in events), default=1.0) * unit
    for e in events:
        start, width = e.start * unit * 1e3, (e.end - e.start) * unit * 1e3
        ax.broken_barh([(start, width)], (row - 0.38, 0.76), color=_PIPELINE_COLORS[e.op.name],
                       alpha=alpha, edgecolor="white", linewidth=0.5)
        if width > span * 1e3 / 60:
            ax.text(start + width / 2, row, str(e.microbatch), ha="center", va="center", fontsize=6)
