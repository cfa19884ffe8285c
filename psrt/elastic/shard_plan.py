"""What one rank reads of a sharded TP x PP commit (:mod:`psrt.elastic.sharded_model`), and
the reading: a :class:`ReadPlan` is made from the commit's index and the rank's own model and
optimizer alone, checked against the files once they are open, and only then read.

Each tensor the rank holds (its ``state_dict``'s, its pipeline copies of parameters tied to
another stage's, its optimizer's state) becomes a target: its block's shape and dtype here,
and the reads (:func:`psrt.elastic.shard_layout.pieces`) that fill it from the saved blocks.
Kept apart from the writer and the collective steps so that the plan reads as one value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from psrt.checkpoint.files import StoredDocument, StoredTensor
from psrt.elastic.shard_layout import BlockLayout, BlockRead, fill, pieces
from psrt.errors import ElasticError
from psrt.full_state import groups_by_position


def tensor_names(module: nn.Module) -> tuple[dict[int, str], dict[str, str]]:
    """Each tensor's name (its first ``state_dict`` key), and every other name of a tensor
    (a shared parameter's second key, a pipeline's tied copies) with its owner's."""
    names: dict[int, str] = {}
    aliases = dict(getattr(module, "tied_aliases", {}))
    for key, tensor in module.state_dict(keep_vars=True).items():
        owner = names.setdefault(id(tensor), key)
        if owner != key:
            aliases[key] = owner
    return names, aliases


def name_of(param: torch.Tensor, names: dict[int, str]) -> str:
    """The name of an optimizer's parameter (``names`` from :func:`tensor_names`)."""
    if id(param) not in names:
        raise ElasticError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not the model's: "
                           "pass TorchState the model the optimizer was built on")
    return names[id(param)]


@dataclass
class Restored:
    """What a rank read: its model's ``state_dict`` (every key), its optimizer's
    ``state_dict`` (None without one), and its pipeline copies of tied parameters with their
    values."""

    model: dict[str, torch.Tensor]
    optimizer: dict | None
    ties: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Read:
    """One read: ``piece`` of the block at ``path`` in ``file``'s document, laid out as ``layout``."""

    file: str
    path: tuple[str, ...]
    layout: BlockLayout
    piece: BlockRead


@dataclass(frozen=True)
class _Target:
    """One tensor a rank restores: its block's shape and dtype here, and its reads."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    reads: list[_Read]


class ReadPlan:
    """What one rank reads, from the commit's index alone: a target for each tensor it holds
    (its ``state_dict``'s, its pipeline copies of tied parameters', its optimizer state's).
    Raises :class:`ElasticError` naming the tensor when the commit lacks one or holds it with
    another shape."""

    def __init__(self, module: nn.Module, optimizer: object, index: dict) -> None:
        self.files_index = index["files"]
        names, aliases = tensor_names(module)
        self.aliases = {**index["aliases"], **aliases}
        entries = module.state_dict(keep_vars=True)
        self.state_keys = {key: id(tensor) for key, tensor in entries.items()}
        tensors = {id(tensor): tensor for tensor in entries.values()}
        known: dict[int, list[str]] = {}
        for key, slot in self.state_keys.items():
            known.setdefault(slot, []).append(key)
        copies = [tie for tie in getattr(module, "ties", ()) if not tie.is_owner]  # buffers outside the state_dict
        self.ties = [tie.tensor for tie in copies]
        for tie in copies:
            known[id(tie.tensor)], tensors[id(tie.tensor)] = list(tie.names), tie.tensor
        saved = {name for entry in self.files_index.values() for name in entry["model"]}
        sources = {slot: self._source(keys, saved) for slot, keys in known.items()}
        missing = [known[slot][0] for slot, source in sources.items() if source is None]
        if missing:
            raise ElasticError(f"the commit lacks {len(missing)} of this rank's entries, {missing[:5]}: it is of "
                               "another model")
        self.model = {slot: self._target(("model", sources[slot]), BlockLayout.of(tensor, like=tensor), tensor.dtype)
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

    def _target(self, path: tuple[str, ...], wanted: BlockLayout, dtype: torch.dtype) -> _Target:
        where = "/".join(path)
        saved = [(file, BlockLayout.from_json(value.get("layout", value), f"{where} in {file}"))
                 for file, value in self._saved(path)]
        found = pieces(wanted, [layout for _, layout in saved], where)
        return _Target(wanted.block_shape, dtype, [_Read(saved[k][0], path, saved[k][1], piece) for k, piece in found])

    def _optimizer_targets(self, optimizer: object, names: dict[int, str], index: dict) -> dict:
        """The optimizer's ``state_dict`` by position, with targets in place of tensors: a
        state tensor shaped like its parameter (Adam's moments) is read as the parameter's
        block, any other whole."""
        params = [param for group in optimizer.param_groups for param in group["params"]]
        saved = {name for entry in self.files_index.values() for name in entry["optimizer"]}
        state = {}
        for position, param in enumerate(params):
            source = self._source([name_of(param, names)], saved)
            if source is None:
                continue  # no state yet (a parameter that never had a gradient)
            entry = {}
            for key, value in self._saved(("optimizer", source))[0][1].items():
                if "value" in value:
                    entry[key] = value["value"]
                    continue
                first = BlockLayout.from_json(value["layout"], f"optimizer/{source}/{key}")
                own = BlockLayout.of(param, like=param)
                wanted = BlockLayout(own.shape, own.sharding, first.dtype) if first.shape == own.shape else \
                    BlockLayout(first.shape, None, first.dtype)
                entry[key] = self._target(("optimizer", source, key), wanted, _dtype(first.dtype))
            state[position] = entry
        in_groups = {name for group in index["param_groups"] for name in group["params"]}
        groups = groups_by_position(optimizer, index["param_groups"],
                                    lambda p: self._source([name_of(p, names)], in_groups) or name_of(p, names))
        return {"state": state, "param_groups": groups}

    def _targets(self) -> list[_Target]:
        found = list(self.model.values())
        if self.optimizer is not None:
            found += [value for entry in self.optimizer["state"].values() for value in entry.values()
                      if isinstance(value, _Target)]
        return found

    def files(self) -> list[str]:
        """The commit's files this rank reads from."""
        return sorted({read.file for target in self._targets() for read in target.reads})

    def check(self, opened: dict[str, StoredDocument]) -> None:
        """Every block this rank reads is in its (open) file with the shape and dtype the
        index gives; raises :class:`ElasticError` naming the file and the tensor."""
        for target in self._targets():
            for read in target.reads:
                stored, where = _lookup(opened[read.file].document, read.path), "/".join(read.path)
                if not isinstance(stored, StoredTensor):
                    raise ElasticError(f"{read.file} holds no tensor {where}, which the commit's index names")
                if tuple(stored.shape) != read.layout.block_shape or stored.dtype != _dtype(read.layout.dtype):
                    raise ElasticError(f"{read.file}: {where} has shape {list(stored.shape)} and {stored.dtype}, the "
                                       f"commit's index says {list(read.layout.block_shape)} and {read.layout.dtype}")

    def read(self, opened: dict[str, StoredDocument]) -> Restored:
        """Every target read into new tensors (nothing the rank holds changes)."""
        values = {slot: _read(target, opened) for slot, target in self.model.items()}
        optimizer = None
        if self.optimizer is not None:
            state = {position: {key: _read(value, opened) if isinstance(value, _Target) else value
                                for key, value in entry.items()}
                     for position, entry in self.optimizer["state"].items()}
            optimizer = {"state": state, "param_groups": self.optimizer["param_groups"]}
        return Restored({key: values[slot] for key, slot in self.state_keys.items()}, optimizer,
                        [(tie, values[id(tie)]) for tie in self.ties])


def _read(target: _Target, opened: dict[str, StoredDocument]) -> torch.Tensor:
    """The block of ``target``: its one read itself where that is all of it (no second copy),
    else its reads put together one at a time."""
    if len(target.reads) == 1 and target.reads[0].piece.narrow is None:
        part = _read_piece(target.reads[0], opened)
        if tuple(part.shape) == target.shape:
            return part.to(target.dtype)
    block = torch.zeros(target.shape, dtype=target.dtype)  # rows past an odd vocabulary stay zero
    for read in target.reads:
        fill(block, _read_piece(read, opened), read.piece)
    return block


def _read_piece(read: _Read, opened: dict[str, StoredDocument]) -> torch.Tensor:
    dim, begin, end = read.piece.rows
    stored = _lookup(opened[read.file].document, read.path)
    return stored.read() if dim is None else stored.read(dim, begin, end)


def _lookup(document: object, path: tuple[str, ...]) -> object:
    for part in path:
        document = document.get(part) if isinstance(document, dict) else None
    return document


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ElasticError(f"the commit's index names dtype {name!r}, which torch does not know")
    return dtype
