"""A TP x PP model and its optimizer, committed as the blocks each rank holds and restored on
any grid by reading only the rows each rank needs.

Gathering the whole model and optimizer at a commit (:class:`psrt.full_state.FullState`,
what psrt did before) puts all of it in every rank's host memory for a moment, so a model
that only fits when split could not commit.  Here each (TP, PP) coordinate's first data-
and context-parallel rank writes, to a file of its own, its TP blocks of its stage's
entries and of their optimizer state (the state tensors shaped like their parameter, such
as Adam's moments; other state whole), and the other ranks of its expert-parallel set write
their experts'.  The commit's replicated document holds a small index: each file's size
and sha256 and, per tensor, its :class:`~psrt.elastic.shard_layout.Layout`, plus the
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
from dataclasses import dataclass

import torch
from torch import nn

from psrt import runtime
from psrt.checkpoint import files as checkpoint_files
from psrt.elastic.shard_layout import Layout, fill, pieces
from psrt.ep import expert_parameters
from psrt.errors import ElasticError
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
        failure = f"rank {runtime.rank()}: {type(exc).__name__}: {exc}"
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
    names, aliases = _names(module)
    model, layouts = {}, {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if names[id(tensor)] == key and (experts is None or id(tensor) in experts):
            model[key] = copies["model"][key]
            layouts[key] = Layout.of(model[key], like=tensor).to_json()
    tensors, states, groups = {}, {}, []
    if optimizer is not None:
        saved = copies["optimizer"]
        params = [param for group in optimizer.param_groups for param in group["params"]]
        for position, param in enumerate(params):
            name = _name_of(param, names)
            if experts is not None and id(param) not in experts:
                continue
            for key, value in saved["state"].get(position, {}).items():
                if isinstance(value, torch.Tensor):  # shaped like its parameter: laid out as it is
                    layout = Layout.of(value, like=param if value.shape == param.shape else None)
                    tensors.setdefault(name, {})[key] = value
                    states.setdefault(name, {})[key] = {"layout": layout.to_json()}
                else:
                    states.setdefault(name, {})[key] = {"value": value}
        groups = [dict({k: v for k, v in options.items() if k != "params"},
                       params=[_name_of(param, names) for param in group["params"]])
                  for options, group in zip(saved["param_groups"], optimizer.param_groups)]
    if not model and not states:
        return None
    return ({"model": model, "optimizer": tensors},
            {"model": layouts, "optimizer": states, "param_groups": groups, "aliases": aliases})


def _names(module: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """Each tensor's name (its first ``state_dict`` key), and every other name of a tensor
    (a shared parameter's second key, a pipeline's tied copies) with its owner's."""
    names: dict[int, str] = {}
    aliases = dict(getattr(module, "tied_aliases", {}))
    for key, tensor in module.state_dict(keep_vars=True).items():
        owner = names.setdefault(id(tensor), key)
        if owner != key:
            aliases[key] = owner
    return names, aliases


def _name_of(param: torch.Tensor, names: dict[int, str]) -> str:
    if id(param) not in names:
        raise ElasticError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not the model's: "
                           "pass TorchState the model the optimizer was built on")
    return names[id(param)]


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


@dataclass
class Restored:
    """What a rank read: its model's ``state_dict`` (every key), its optimizer's
    ``state_dict`` (None without one), and its pipeline copies of tied parameters with their
    values."""

    model: dict[str, torch.Tensor]
    optimizer: dict | None
    ties: list[tuple[torch.Tensor, torch.Tensor]]


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
            plan = _Plan(module, optimizer, index)
            for file in plan.files():
                opened[file] = _open(index, directory, file)
            plan.check(opened)
        except Exception as exc:  # every rank learns of it below
            failure = f"rank {runtime.rank()}: {exc}"
        _raise_any(functions.allgather_object(failure, name="psrt.elastic.resume.shards"),
                   "cannot restore the model's shards")
        restored, failure = None, None
        try:
            restored = plan.read(opened)
        except Exception as exc:
            failure = f"rank {runtime.rank()}: {type(exc).__name__}: {exc}"
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


def _raise_any(failures: list, what: str) -> None:
    errors = [failure for failure in failures if failure]
    if errors:
        raise ElasticError(f"{what}: {'; '.join(errors)}")


@dataclass(frozen=True)
class _Target:
    """One tensor a rank restores: its shape and dtype here, and its reads (file, path in
    the file's document, the saved block's layout, piece)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    reads: list[tuple]


class _Plan:
    """What one rank reads, from the index alone: a target for each tensor it holds (its
    ``state_dict``'s, its pipeline copies of tied parameters', its optimizer state's)."""

    def __init__(self, module: nn.Module, optimizer: object, index: dict) -> None:
        if index.get("format") != FORMAT:
            raise ElasticError(f"the commit's shards are of format {index.get('format')!r}, this psrt reads {FORMAT}")
        self.files_index = index["files"]
        names, aliases = _names(module)
        self.aliases = {**index["aliases"], **aliases}
        self.state_keys = {key: id(tensor) for key, tensor in module.state_dict(keep_vars=True).items()}
        tensors = {id(tensor): tensor for tensor in module.state_dict(keep_vars=True).values()}
        known: dict[int, list[str]] = {}
        for key, slot in self.state_keys.items():
            known.setdefault(slot, []).append(key)
        self.ties = [tie.tensor for tie in getattr(module, "ties", ()) if not tie.is_owner]
        for tie in getattr(module, "ties", ()):
            if not tie.is_owner:
                known[id(tie.tensor)], tensors[id(tie.tensor)] = list(tie.names), tie.tensor
        saved = {name for entry in self.files_index.values() for name in entry["model"]}
        sources = {slot: self._source(keys, saved) for slot, keys in known.items()}
        missing = [known[slot][0] for slot, source in sources.items() if source is None]
        if missing:
            raise ElasticError(f"the commit lacks {len(missing)} of this rank's entries, {missing[:5]}: it is of "
                               "another model")
        self.model = {slot: self._target(("model", sources[slot]), Layout.of(tensor, like=tensor), tensor.dtype)
                      for slot, tensor in tensors.items()}
        self.optimizer = None if optimizer is None else self._optimizer_targets(optimizer, names, index)

    def _source(self, names: list[str], saved: set[str]) -> str | None:
        """The name the commit holds a tensor under: one of its own, or their owner's."""
        return next((n for n in names if n in saved), None) or \
            next((self.aliases[n] for n in names if self.aliases.get(n) in saved), None)

    def _saved(self, path: tuple[str, ...]) -> list[tuple[str, dict]]:
        """Every file's entry for ``path`` (("model", name) or ("optimizer", name, key))."""
        found = [(file, _lookup(entry, path)) for file, entry in self.files_index.items()]
        return [(file, value) for file, value in found if value is not None]

    def _target(self, path: tuple[str, ...], wanted: Layout, dtype: torch.dtype) -> _Target:
        where = "/".join(path)
        saved = [(file, Layout.from_json(value.get("layout", value), f"{where} in {file}"))
                 for file, value in self._saved(path)]
        reads = [(saved[k][0], path, saved[k][1], piece) for k, piece in pieces(wanted, [s for _, s in saved], where)]
        return _Target(wanted.block_shape, dtype, reads)

    def _optimizer_targets(self, optimizer: object, names: dict[int, str], index: dict) -> dict:
        """The optimizer's ``state_dict`` by position, with targets in place of tensors: a
        state tensor shaped like its parameter (Adam's moments) is read as the parameter's
        block, any other whole."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        saved = {name for entry in self.files_index.values() for name in entry["optimizer"]}
        state = {}
        for position, param in enumerate(params):
            source = self._source([_name_of(param, names)], saved)
            if source is None:
                continue  # no state yet (a parameter that never had a gradient)
            entry = {}
            for key, value in self._saved(("optimizer", source))[0][1].items():
                if "value" in value:
                    entry[key] = value["value"]
                    continue
                first = Layout.from_json(value["layout"], f"optimizer/{source}/{key}")
                own = Layout.of(param, like=param)
                wanted = Layout(own.shape, own.sharding, first.dtype) if first.shape == own.shape else \
                    Layout(first.shape, None, first.dtype)
                entry[key] = self._target(("optimizer", source, key), wanted, _dtype(first.dtype))
            state[position] = entry
        in_groups = {name for group in index["param_groups"] for name in group["params"]}
        groups, start = [], 0
        for group in optimizer.param_groups:
            first = _name_of(group["params"][0], names)
            source = self._source([first], in_groups)
            options = next((g for g in index["param_groups"] if source in g["params"]), None)
            if options is None:
                raise ElasticError(f"parameter {first!r} is in no parameter group of the commit: it is of another "
                                   "model")
            groups.append(dict({k: v for k, v in options.items() if k != "params"},
                               params=list(range(start, start + len(group["params"])))))
            start += len(group["params"])
        return {"state": state, "param_groups": groups}

    def _targets(self) -> list[_Target]:
        found = list(self.model.values())
        if self.optimizer is not None:
            found += [value for entry in self.optimizer["state"].values() for value in entry.values()
                      if isinstance(value, _Target)]
        return found

    def files(self) -> list[str]:
        return sorted({read[0] for target in self._targets() for read in target.reads})

    def check(self, opened: dict) -> None:
        """Every block this rank reads is in its file with the shape and dtype the index gives."""
        for target in self._targets():
            for file, path, layout, _ in target.reads:
                stored = _lookup(opened[file].document, path)
                if not isinstance(stored, checkpoint_files.StoredTensor):
                    raise ElasticError(f"{file} holds no tensor {'/'.join(path)}, which the commit's index names")
                if tuple(stored.shape) != layout.block_shape or stored.dtype != _dtype(layout.dtype):
                    raise ElasticError(f"{file}: {'/'.join(path)} has shape {list(stored.shape)} and {stored.dtype}, "
                                       f"the commit's index says {list(layout.block_shape)} and {layout.dtype}")

    def read(self, opened: dict) -> Restored:
        values = {slot: _read(target, opened) for slot, target in self.model.items()}
        optimizer = None
        if self.optimizer is not None:
            state = {position: {key: _read(value, opened) if isinstance(value, _Target) else value
                                for key, value in entry.items()}
                     for position, entry in self.optimizer["state"].items()}
            optimizer = {"state": state, "param_groups": self.optimizer["param_groups"]}
        return Restored({key: values[slot] for key, slot in self.state_keys.items()}, optimizer,
                        [(tie, values[id(tie)]) for tie in self.ties])


def _read(target: _Target, opened: dict) -> torch.Tensor:
    block = torch.zeros(target.shape, dtype=target.dtype)  # rows past an odd vocabulary stay zero
    for file, path, _, piece in target.reads:
        dim, begin, end = piece.rows
        stored = _lookup(opened[file].document, path)
        fill(block, stored.read() if dim is None else stored.read(dim, begin, end), piece)
    return block


def _lookup(document: object, path: tuple[str, ...]) -> object:
    for part in path:
        document = document.get(part) if isinstance(document, dict) else None
    return document


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ElasticError(f"the commit's index names dtype {name!r}, which torch does not know")
    return dtype
