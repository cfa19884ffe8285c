"""Horovod's elastic state objects: ``State``, ``ObjectState`` and ``TorchState``.

``commit()`` keeps a copy in memory (``restore()`` goes back to it, as in Horovod) and,
under ``psrun --min-np/--max-np``, writes it to the job's commit directory
(:mod:`psrt.elastic.commits`) so that a relaunched job starts from it: replicated state
once (rank 0), each rank's own state (its RNG states, the TP RNG tracker's streams) per
rank, and sharded optimizers (ZeRO, parameter servers) through their own checkpoints, which
a job of another size loads.  What is committed is told by the state protocol
(:mod:`psrt.stateful`), never by an optimizer's type: a :class:`~psrt.stateful.Stateful`
optimizer is committed with the model, a :class:`~psrt.stateful.ShardedStateful` one writes
its own directory.  A TP x PP model is committed whole (:class:`psrt.full_state.FullState`,
gathered over the grid), so that a commit restores on another grid, or without one.
"""
from __future__ import annotations

import abc
import copy
import os
import random

import numpy as np
import torch

from psrt import runtime
from psrt.elastic.commits import ENV_HOSTS_VERSION, REPLICATED, CommitStore, rank_file
from psrt.elastic.sampler import ElasticSampler
from psrt.errors import ArgumentTypeError, ElasticError, HostsUpdatedInterrupt
from psrt.full_state import FullState
from psrt.runtime import global_process_set
from psrt.stateful import ShardedStateful, Stateful
from psrt.topology import ProcessSet
from psrt.torch import functions
from psrt.tp.random import rng_tracker

_PLAIN = (bool, int, float, str, bytes, type(None), torch.Tensor, torch.dtype, torch.Size)


def _check_plain(value: object, where: str) -> None:
    """Commits hold tensors and plain data only (safetensors and JSON, so a commit can never
    run code): refuse anything else, naming where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, where)
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
    elif not isinstance(value, _PLAIN):
        raise ElasticError(f"{where} is a {type(value).__name__}: a committed value must be tensors and plain "
                           "data (numbers, strings, lists, tuples, dicts); store its state_dict() instead")


class State(abc.ABC):
    """Horovod's ``hvd.elastic.State``: subclasses define ``save``, ``restore`` and ``sync``
    and the parts written at each commit."""

    def __init__(self) -> None:
        self._reset_callbacks: list = []
        self._store = CommitStore.from_env()
        self._launch_hosts_version = int(os.environ.get(ENV_HOSTS_VERSION, "0"))
        self._commit_number = 0  # the commit this process last wrote or resumed from (0: none)
        self._last_in_store: int | None = None  # the pointer's commit when the store was opened
        self.restored_from: int | None = None  # the commit this launch resumed from

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions called (without arguments) when the job resumes after a reset, e.g. to
        scale the learning rate to the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Keep the state as it is now: a later ``restore()``, or a relaunch after a failure,
        comes back here.  Then raises :class:`HostsUpdatedInterrupt` on every rank if the hosts
        changed.

        Collective: every rank of the world calls it, in the same order.
        """
        self.save()
        if self._store.root is not None:
            self._persist()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank if psrun reported new hosts
        since this launch (rank 0 looks, every rank learns the answer).

        Collective: every rank of the world calls it, in the same order.
        """
        if self._store.root is None:
            return
        changed = runtime.rank() == 0 and self._store.hosts_version() > self._launch_hosts_version
        if functions.broadcast_object(changed, 0, name="psrt.elastic.hosts_changed"):
            raise HostsUpdatedInterrupt(skip_sync=False)

    @abc.abstractmethod
    def save(self) -> None:
        """Keep the state as it is now, in memory (``commit()`` then writes it)."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Go back to what ``save()`` kept."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every rank hold rank 0's state.

        Collective: every rank of the world calls it, in the same order.
        """

    # --- persistence: subclasses say what goes into a commit ---------------------------------

    def _write_collective(self, directory: str) -> None:
        """Collective writes into the commit's directory (sharded optimizers' checkpoints)."""

    def _replicated_document(self) -> dict:
        return {}

    def _rank_document(self) -> dict:
        return {}

    def _layout(self) -> dict:
        """The layout the state was committed on (e.g. a TP/PP grid)."""
        return {}

    def _restores_on_any_layout(self) -> bool:
        """Whether a commit of this state may be read back on another layout than its own."""
        return True

    @abc.abstractmethod
    def _read(self, replicated: dict, mine: dict | None, same_layout: bool) -> None:
        """Take the committed state: ``replicated`` (rank 0's file) and ``mine`` (this rank's,
        None for a rank the commit's job did not have; from another layout when not
        ``same_layout``), then restore it."""

    def _open_store(self) -> dict | None:
        """The record of the last commit in the directory, or None; collective, once per
        launch.  Rank 0 reads (and refuses commits without a valid pointer); a directory
        without one gets its pointer now, before any commit directory exists."""
        record, failure = None, None
        if runtime.rank() == 0:
            try:
                record = self._store.latest()
                if record is None:
                    self._store.start()
            except (ElasticError, OSError) as exc:
                failure = str(exc)
        record, failure = functions.broadcast_object((record, failure), 0, name="psrt.elastic.resume")
        if failure:
            raise ElasticError(failure)
        self._last_in_store = record["commit"] if record is not None else 0
        return record

    def _persist(self) -> None:
        if self._last_in_store is None:  # committing without elastic.run(): the directory is still unread
            self._open_store()
        # Numbers only grow in a directory, so a commit never lands in one this job did not write.
        number = max(self._commit_number, self._last_in_store) + 1
        directory = self._store.begin(number)
        self._write_collective(directory)  # raises on every rank together
        failure, files = None, {}
        try:
            if runtime.rank() == 0:
                document = self._replicated_document()
                _check_plain(document, "the committed state")
                files.update(self._store.save(document, number, REPLICATED))
            files.update(self._store.save(self._rank_document(), number, rank_file(runtime.rank())))
        except Exception as exc:  # every rank learns of it below
            failure = f"rank {runtime.rank()}: {type(exc).__name__}: {exc}"
        outcomes = functions.allgather_object((failure, files), name="psrt.elastic.commit.files")
        errors = [error for error, _ in outcomes if error]
        if not errors and runtime.rank() == 0:
            try:
                self._store.publish({"commit": number, "size": runtime.size(), "layout": self._layout(),
                                     "any_layout": self._restores_on_any_layout(),
                                     "files": {name: rec for _, written in outcomes for name, rec in written.items()}},
                                    replaces=self._commit_number)
            except Exception as exc:
                errors.append(f"rank 0: {type(exc).__name__}: {exc}")
        errors = functions.broadcast_object(errors, 0, name="psrt.elastic.commit.outcome")
        if errors:
            raise ElasticError(f"commit {number} failed, the previous commit stays: {'; '.join(errors)}")
        self._commit_number = self._last_in_store = number

    def _resume(self) -> bool:
        """Restore the last commit of an earlier launch, if there is one; collective.  Returns
        whether it did (every rank then holds the same committed state).  A failure is also
        reported to psrun (:meth:`CommitStore.report_restore_failure`), whatever raised it: a
        ZeRO or parameter-server checkpoint in the commit that fails to load as well."""
        try:
            return self._restore_last_commit()
        except Exception as exc:
            if runtime.rank() == 0:
                self._store.report_restore_failure(str(exc) if isinstance(exc, ElasticError)
                                                   else f"{type(exc).__name__}: {exc}")
            raise

    def _restore_last_commit(self) -> bool:
        record = self._open_store()
        if record is None:
            return False
        failure = None
        same_layout = record.get("layout", {}) == self._layout()
        try:
            if not same_layout and not record.get("any_layout"):
                raise ElasticError(f"commit {record['commit']} was made with layout {record.get('layout')}, this "
                                   f"launch has {self._layout()}: its state is sharded over the TP/PP grid (a "
                                   "sharded optimizer's, or a per-rank commit of an earlier psrt) and restores only "
                                   "on the same grid (keep --min-np and --max-np at its size)")
            replicated = self._store.load(record, REPLICATED)
            name = rank_file(runtime.rank())
            mine = self._store.load(record, name) if name in record["files"] else None
        except Exception as exc:
            failure = f"rank {runtime.rank()}: {exc}"
        errors = [error for error in functions.allgather_object(failure, name="psrt.elastic.resume.read") if error]
        if errors:
            raise ElasticError(f"cannot resume from commit {record['commit']}: {'; '.join(errors)}")
        self._commit_number = self.restored_from = record["commit"]
        self._read(replicated, mine, same_layout)
        return True


class ObjectState(State):
    """Horovod's ``hvd.elastic.ObjectState(**kwargs)``: each keyword becomes an attribute,
    committed and restored as a whole and made equal to rank 0's by ``sync()``."""

    def __init__(self, **kwargs) -> None:
        super().__init__()
        self._saved_state = copy.deepcopy(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        """Make every rank hold rank 0's state.

        Collective: every rank of the world calls it, in the same order.
        """
        if self._saved_state:
            self._saved_state = functions.broadcast_object(self._saved_state, 0, name="psrt.elastic.objects")
            self.restore()

    def _replicated_document(self) -> dict:
        return {"objects": self._saved_state}

    def _read(self, replicated: dict, mine: dict | None, same_layout: bool) -> None:
        self._saved_state = replicated["objects"]
        self.restore()


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
    over ``grid.dp_set``, and a commit gathers them whole over the grid
    (:class:`psrt.full_state.FullState`), so it restores on any grid, or as a plain data-
    parallel model (the same single-process model's names); a sharded optimizer's commit
    restores on the same grid only.
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
        self._full: dict | None = None  # the model and optimizer, whole, gathered at the last commit
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
        elif self.grid is not None and self._owns_model():  # commit() saved just now: the live model is the copy
            self._full = FullState(self.model, self.optimizer, self.grid).state_dict()

    def _replicated_document(self) -> dict:
        document = dict(super()._replicated_document(), samplers=self._copies["samplers"])
        if self.grid is None:
            document.update({key: self._copies[key] for key in ("model", "optimizer") if key in self._copies})
        elif self._full is not None:
            document["full"] = self._full
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
        if "full" in replicated and self._owns_model():  # a TP x PP commit, made on any grid
            FullState(self.model, self.optimizer, self.grid).load_state_dict(replicated["full"])
            held = {"model": {key: value.detach().clone() for key, value in self.model.state_dict().items()}}
            if self.optimizer is not None:
                held["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        else:  # grid-less commits, and per-rank TP x PP ones of an earlier psrt (same grid)
            held = replicated if self.grid is None else (mine or {})
        self._copies = {"rng": rng, "samplers": replicated["samplers"],
                        **{key: held[key] for key in ("model", "optimizer") if key in held}}
        self.restore()  # sharded optimizers load the commit's own checkpoint here


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
