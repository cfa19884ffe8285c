"""A TP x PP model and its optimizer, committed as the blocks each rank holds and restored on
any grid by reading only the rows each rank needs.

Gathering the whole model and optimizer at a commit (:class:`psrt.full_state.FullState`,
what psrt did before) puts all of it in every rank's host memory for a moment, so a model
that only fits when split could not commit.  Here each (TP, PP) coordinate's first data-
and context-parallel rank writes, to a file of its own, its TP blocks of its stage's
entries and of their optimizer state (the state tensors shaped like their parameter, such
as Adam's moments; other state whole), and the other ranks of its expert-parallel set write
their experts'.  The commit's replicated document holds a small index: each file's size
and sha256 and, per tensor, its :class:`~psrt.elastic.shard_layout.BlockLayout`, plus the
parameter groups' options.  A rank restoring on another grid, or without one, plans from
the index alone which rows of which files make up each of its blocks, opens only those
files (each checked against its record), agrees with every other rank that all is well,
and only then reads those rows into new tensors; nothing it holds has changed until every
rank has read everything.

Tensors are named by their ``state_dict`` key, the single-process model's whatever the
layout; a pipeline's copy of a parameter tied to another stage's, and a plain model's
second name for a shared parameter, take their owner's value (the index keeps the aliases).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from psrt import runtime
from psrt.checkpoint import files as checkpoint_files
from psrt.elastic.shard_layout import BlockLayout
from psrt.elastic.shard_plan import ReadPlan, Restored, name_of, tensor_names
from psrt.ep import expert_parameters
from psrt.errors import ElasticError, PsrtError
from psrt.grid import ProcessGrid
from psrt.torch import functions

FORMAT = 1  # the index's own format, beside the commit's


def write_shards(module: nn.Module, optimizer: object, copies: dict, grid: ProcessGrid, directory: str) -> dict:
    """Write this rank's blocks (if it is one that writes) into ``directory`` and return the
    index of every rank's files.  ``copies`` is what ``TorchState.save()`` kept (``"model"``:
    the ``state_dict``, ``"optimizer"``: the optimizer's): what is written; the live tensors
    of ``module`` only say how each is laid out.

    Collective: every rank of the world calls it, in the same order.  A write that fails on
    one rank raises :class:`ElasticError` on every rank.
    """
    failure, entry = None, None
    try:
        shard = _shard(module, optimizer, copies, grid)
        if shard is not None:
            document, entry = shard
            at = grid.coords
            entry["file"] = f"model-pp{at.pp:03d}-tp{at.tp:03d}-ep{at.dp:03d}.pt"
            entry["record"] = checkpoint_files.save_tensors(document, os.path.join(directory, entry["file"])).to_json()
    except Exception as exc:  # every rank learns of it below
        failure = _failure(exc)
    outcomes = functions.allgather_object((failure, entry), name="psrt.elastic.commit.shards")
    _raise_any([error for error, _ in outcomes], "cannot write the model's shards")
    return _index([entry for _, entry in outcomes if entry is not None])


def _shard(module: nn.Module, optimizer: object, copies: dict, grid: ProcessGrid) -> tuple[dict, dict] | None:
    """The document this rank writes and its entry in the index, or None when its blocks are
    another rank's to write (data- and context-parallel replicas)."""
    at = grid.coords
    if at.cp or at.dp >= grid.shape.ep:
        return None
    experts = {id(p) for _, p in expert_parameters(module)[0]} if at.dp else None  # an EP rank: its experts only
    names, aliases = tensor_names(module)
    model, layouts = {}, {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if names[id(tensor)] == key and (experts is None or id(tensor) in experts):
            model[key] = copies["model"][key]
            layouts[key] = BlockLayout.of(model[key], like=tensor).to_json()
    tensors, states, groups = {}, {}, []
    if optimizer is not None:
        saved = copies["optimizer"]
        params = [param for group in optimizer.param_groups for param in group["params"]]
        for position, param in enumerate(params):
            name = name_of(param, names)
            if experts is not None and id(param) not in experts:
                continue
            for key, value in saved["state"].get(position, {}).items():
                if isinstance(value, torch.Tensor):  # shaped like its parameter: laid out as it is
                    layout = BlockLayout.of(value, like=param if value.shape == param.shape else None)
                    tensors.setdefault(name, {})[key] = value
                    states.setdefault(name, {})[key] = {"layout": layout.to_json()}
                else:
                    states.setdefault(name, {})[key] = {"value": value}
        groups = [dict({k: v for k, v in options.items() if k != "params"},
                       params=[name_of(param, names) for param in group["params"]])
                  for options, group in zip(saved["param_groups"], optimizer.param_groups)]
    if not model and not states:
        return None
    return ({"model": model, "optimizer": tensors},
            {"model": layouts, "optimizer": states, "param_groups": groups, "aliases": aliases})


def _index(entries: list[dict]) -> dict:
    """One index from every writing rank's entry: files, aliases, parameter groups (a group
    every TP rank of a stage has is kept once)."""
    aliases: dict[str, str] = {}
    groups: dict[tuple, dict] = {}
    for entry in entries:
        aliases.update(entry["aliases"])
        groups.update({tuple(group["params"]): group for group in entry["param_groups"]})
    files = {entry["file"]: {key: entry[key] for key in ("record", "model", "optimizer")} for entry in entries}
    return {"format": FORMAT, "files": files, "aliases": aliases, "param_groups": list(groups.values())}


def restore_shards(module: nn.Module, optimizer: object, index: dict, directory: str) -> Restored:
    """This rank's part of the model and optimizer committed with ``index`` (what
    :func:`write_shards` returned) into ``directory``, on any grid: new tensors, read from
    the files that hold them, each file checked against its record first.  Nothing of
    ``module`` or ``optimizer`` changes here.

    Collective: every rank of the world calls it, in the same order.  When a rank cannot (a
    damaged or missing file, a commit of another model), every rank raises
    :class:`ElasticError` naming the rank and what is wrong, before any rank reads a tensor.
    """
    opened: dict[str, checkpoint_files.StoredDocument] = {}
    try:
        failure, plan = None, None
        try:
            if index.get("format") != FORMAT:
                raise ElasticError(f"the commit's shards are of format {index.get('format')!r}, this psrt reads "
                                   f"{FORMAT}")
            plan = ReadPlan(module, optimizer, index)
            for file in plan.files():
                opened[file] = _open(index, directory, file)
            plan.check(opened)
        except Exception as exc:  # every rank learns of it below
            failure = _failure(exc)
        _raise_any(functions.allgather_object(failure, name="psrt.elastic.resume.shards"),
                   "cannot restore the model's shards")
        restored, failure = None, None
        try:
            restored = plan.read(opened)
        except Exception as exc:
            failure = _failure(exc)
        _raise_any(functions.allgather_object(failure, name="psrt.elastic.resume.shards.read"),
                   "cannot read the model's shards")
        return restored
    finally:
        for stored in opened.values():
            stored.close()


def _open(index: dict, directory: str, file: str) -> checkpoint_files.StoredDocument:
    path = os.path.join(directory, file)
    records = {name: entry["record"] for name, entry in index["files"].items()}
    record = checkpoint_files.record_of(records, path, "the commit's index (in replicated.pt)", ElasticError)
    return checkpoint_files.open_tensors(path, record, ElasticError)


def _failure(exc: Exception) -> str:
    """What this rank tells the others: psrt's own errors say what is wrong, others by type."""
    return f"rank {runtime.rank()}: {exc if isinstance(exc, PsrtError) else f'{type(exc).__name__}: {exc}'}"


def _raise_any(failures: list, what: str) -> None:
    errors = [failure for failure in failures if failure]
    if errors:
        raise ElasticError(f"{what}: {'; '.join(errors)}")
