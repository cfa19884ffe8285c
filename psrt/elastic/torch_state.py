"""Horovod's ``TorchState``: the model, its optimizer, samplers and each rank's random
number generators, committed and restored as an elastic state (:mod:`psrt.elastic.state`).

What a commit holds is told by the state protocol (:mod:`psrt.stateful`), never by an
optimizer's type: a :class:`~psrt.stateful.Stateful` optimizer is committed with the model,
a :class:`~psrt.stateful.ShardedStateful` one (ZeRO, parameter servers) writes its own
checkpoint, which a job of another size loads.  A TP x PP model is committed as the blocks
its ranks hold (:mod:`psrt.elastic.sharded_model`), never gathered, and restores on another
grid, or without one, each rank reading only the rows it needs.  Kept apart from the state
base, which says how any state is committed and resumed, because this is what a torch
training loop's state is.
"""
from __future__ import annotations

import copy
import os
import random

import numpy as np
import torch

from psrt import runtime
from psrt.elastic import sharded_model
from psrt.elastic.sampler import ElasticSampler
from psrt.elastic.state import ObjectState
from psrt.errors import ArgumentTypeError
from psrt.full_state import FullState
from psrt.runtime import global_process_set
from psrt.stateful import ShardedStateful, Stateful
from psrt.topology import ProcessSet
from psrt.torch import functions
from psrt.tp.random import rng_tracker


class _Rng:
    """This rank's random number generators: Python's, NumPy's and torch's (CPU, and CUDA's
    once CUDA is in use), and the TP RNG tracker's streams (dropout in tensor-parallel
    regions).  Each rank keeps its own; a rank of a larger relaunch that had no counterpart
    keeps the generators it started with, and a relaunch on another layout keeps the
    tracker's streams that ``psrt.tp.manual_seed`` made (their seeds follow the TP rank)."""

    @staticmethod
    def capture() -> dict:
        kind, keys, position, has_gauss, gauss = np.random.get_state()
        state = {"python": random.getstate(), "torch": torch.get_rng_state(),
                 "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss]}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        state["tp"] = rng_tracker().state_dict()
        return state

    @staticmethod
    def apply(state: dict) -> None:
        random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
        kind, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        if "tp" in state:  # commits of psrt before the tracker was committed lack it
            rng_tracker().load_state_dict(state["tp"])


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState(model=None, optimizer=None, **kwargs)``: the model,
    the optimizer (its state, including what torch creates at the first step), every
    :class:`ElasticSampler` among the keywords, each rank's RNG states, and the other
    keywords as plain values.

    ``optimizer`` may be a ``psrt.torch.DistributedOptimizer`` or plain torch optimizer
    (replicated: committed once), a ``psrt.zero.ZeroOptimizer`` (its sharded checkpoint,
    which holds the model too, and loads at any size) or a ``psrt.ps.DistributedOptimizer``
    (the servers' checkpoint; the model is pulled back from the servers): any
    :class:`~psrt.stateful.Stateful` or :class:`~psrt.stateful.ShardedStateful` optimizer.
    ``grid`` (psrt's addition) says the model is a TP/PP stage: model and optimizer agree
    over ``grid.dp_set``, and a commit writes each (TP, PP) coordinate's blocks of both once
    (:mod:`psrt.elastic.sharded_model`; no rank ever holds more than its own part), so it
    restores on any grid, or as a plain data-parallel model (the same single-process
    model's names), each rank reading only the rows of its own blocks; a sharded
    optimizer's commit restores on the same grid only.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer=None, grid=None, **kwargs) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise ArgumentTypeError(f"TorchState(model=...) takes a torch.nn.Module, got {type(model).__name__}")
        self.samplers = {name: value for name, value in kwargs.items() if isinstance(value, ElasticSampler)}
        plain = {name: value for name, value in kwargs.items() if name not in self.samplers}
        super().__init__(**plain)
        for name, sampler in self.samplers.items():
            setattr(self, name, sampler)
        self.model, self.optimizer, self.grid = model, optimizer, grid
        self._sharded = _is_sharded(optimizer)
        self._shards: dict | None = None  # the index of the model's blocks written at the last commit
        self._process_set: ProcessSet = grid.dp_set if grid is not None else global_process_set
        self._copies: dict = {}
        self.save()

    def _owns_model(self) -> bool:
        """Whether the model's values are committed here (a ZeRO or PS optimizer keeps them)."""
        return self.model is not None and not self._sharded

    def save(self) -> None:
        super().save()
        copies = {"rng": _Rng.capture(),
                  "samplers": {name: sampler.state_dict() for name, sampler in self.samplers.items()}}
        if self._owns_model():
            copies["model"] = {key: value.detach().clone() for key, value in self.model.state_dict().items()}
        if self.optimizer is not None and not self._sharded:
            copies["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        self._copies = copies

    def restore(self) -> None:
        """Go back to what ``save()`` kept (the last commit's, for a ZeRO or parameter-server
        optimizer, which is loaded from its checkpoint).

        Collective with a ZeRO or parameter-server optimizer: every rank of that optimizer's set
        (every worker) calls it, in the same order.  Otherwise local.
        """
        super().restore()
        copies = self._copies
        _Rng.apply(copies["rng"])
        for name, sampler in self.samplers.items():
            sampler.load_state_dict(copies["samplers"][name])
        if "model" in copies:
            self.model.load_state_dict(copies["model"])
        if "optimizer" in copies:
            self.optimizer.load_state_dict(copy.deepcopy(copies["optimizer"]))
        if self._sharded and self._commit_number:
            self.optimizer.load(os.path.join(self._store.directory(self._commit_number),
                                             self.optimizer.checkpoint_name))

    def sync(self) -> None:
        """Make every rank hold rank 0's state (the model and optimizer over ``grid.dp_set`` with a
        grid).

        Collective: every rank of the world calls it, in the same order.
        """
        root = self.grid.runtime.topology.ranks_of(self._process_set)[0] if self.grid is not None else 0
        if self._owns_model():
            functions.broadcast_parameters(self.model.state_dict(), root, process_set=self._process_set)
        if self.optimizer is not None and not self._sharded:
            functions.broadcast_optimizer_state(self.optimizer, root, model=self.model,
                                                process_set=self._process_set)
        for name, sampler in self.samplers.items():  # rank 0's position, as Horovod, and every rank's marks
            states = functions.allgather_object(sampler.state_dict(), name=f"psrt.elastic.sampler.{name}")
            sampler.load_state_dict(dict(states[0], processed=torch.stack([s["processed"] for s in states]).any(dim=0)))
        ObjectState.sync(self)
        self.save()

    def _write_collective(self, directory: str) -> None:
        if self._sharded:
            self.optimizer.save(os.path.join(directory, self.optimizer.checkpoint_name))
        elif self.grid is not None and self._owns_model():
            self._shards = sharded_model.write_shards(self.model, self.optimizer, self._copies, self.grid, directory)

    def _replicated_document(self) -> dict:
        document = dict(super()._replicated_document(), samplers=self._copies["samplers"])
        if self.grid is None:
            document.update({key: self._copies[key] for key in ("model", "optimizer") if key in self._copies})
        elif self._shards is not None:
            document["shards"] = self._shards
        return document

    def _rank_document(self) -> dict:
        return {"rng": self._copies["rng"]}

    def _layout(self) -> dict:
        if self.grid is None:
            return {}
        shape = self.grid.shape
        return {"size": runtime.size(),
                "grid": {"dp": shape.dp, "tp": shape.tp, "pp": shape.pp, "cp": shape.cp, "ep": shape.ep}}

    def _restores_on_any_layout(self) -> bool:
        return self.grid is None or self._owns_model()

    def _read(self, replicated: dict, mine: dict | None, same_layout: bool) -> None:
        self._saved_state = replicated["objects"]
        rng = mine["rng"] if mine is not None else _Rng.capture()
        if not same_layout:
            rng.pop("tp", None)
        if "shards" in replicated and self._owns_model():  # a TP x PP commit, made on any grid
            self._take_shards(replicated, rng)
            return
        if "full" in replicated and self._owns_model():  # one of psrt before, gathered whole
            FullState(self.model, self.optimizer, self.grid).load_state_dict(replicated["full"])
            held = {"model": {key: value.detach().clone() for key, value in self.model.state_dict().items()}}
            if self.optimizer is not None:
                held["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        else:  # grid-less commits, and per-rank TP x PP ones of an earlier psrt (same grid)
            held = replicated if self.grid is None else (mine or {})
        self._copies = {"rng": rng, "samplers": replicated["samplers"],
                        **{key: held[key] for key in ("model", "optimizer") if key in held}}
        self.restore()  # sharded optimizers load the commit's own checkpoint here

    def _take_shards(self, replicated: dict, rng: dict) -> None:
        """Restore this rank's blocks of a sharded commit (collective, see
        :func:`~psrt.elastic.sharded_model.restore_shards`).  The tensors read become the kept
        copy of the model and the optimizer's own state, and the optimizer's kept copy is
        written into the previous one's tensors, so a rank never holds more than one extra
        copy of its part of the model and optimizer."""
        restored = sharded_model.restore_shards(self.model, self.optimizer, replicated["shards"],
                                                self._store.directory(self._commit_number))
        previous = self._copies.get("optimizer")
        self._copies = {"rng": rng, "samplers": replicated["samplers"], "model": restored.model}
        if self.optimizer is not None:
            self.optimizer.load_state_dict(restored.optimizer)  # takes the tensors as they are
        self.restore()
        if self.optimizer is not None:
            self._copies["optimizer"] = _copy_into(self.optimizer.state_dict(), previous)
        with torch.no_grad():
            for copy_of_tied, value in restored.ties:  # a pipeline's copies of parameters another stage owns
                copy_of_tied.copy_(value)


def _copy_into(state: dict, previous: dict | None) -> dict:
    """A copy of an optimizer's ``state_dict``, made in the tensors of ``previous`` (an earlier
    copy, to be dropped) where they match in shape and dtype, new where they do not."""
    old = (previous or {}).get("state", {})
    copied = {}
    for index, entry in state["state"].items():
        copied[index] = {}
        for key, value in entry.items():
            buffer = old.get(index, {}).get(key)
            fits = isinstance(value, torch.Tensor) and isinstance(buffer, torch.Tensor) and \
                (buffer.shape, buffer.dtype) == (value.shape, value.dtype)
            copied[index][key] = buffer.copy_(value) if fits else copy.deepcopy(value)
    return {"state": copied, "param_groups": copy.deepcopy(state["param_groups"])}


def _is_sharded(optimizer: object) -> bool:
    """Whether ``optimizer`` writes its own sharded checkpoint (which holds the model too), or
    is committed through its ``state_dict``."""
    if isinstance(optimizer, ShardedStateful):
        return True
    if optimizer is None or isinstance(optimizer, Stateful):
        return False
    raise ArgumentTypeError(f"TorchState(optimizer=...) takes a torch optimizer, a psrt DistributedOptimizer, "
                            "ZeroOptimizer or parameter-server DistributedOptimizer (an object with state_dict() "
                            "and load_state_dict(), or a psrt.stateful.ShardedStateful), got "
                            f"{type(optimizer).__name__}")
