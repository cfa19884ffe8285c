"""Horovod's elastic state objects: ``State``, ``ObjectState`` and ``TorchState``.

``commit()`` keeps a copy in memory (``restore()`` goes back to it, as in Horovod) and,
under ``psrun --min-np/--max-np``, writes it to the job's commit directory
(:mod:`psrt.elastic.commits`) so that a relaunched job starts from it: replicated state
once (rank 0), each rank's own state (its RNG states, a TP/PP model's pieces) per rank,
and ZeRO and parameter-server optimizers through their own sharded checkpoints, which a
job of another size loads.  A state is made of parts, one per thing it covers, each
knowing how to copy, restore, agree across ranks and be written.
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
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import functions

_PLAIN = (bool, int, float, str, bytes, type(None), torch.Tensor, torch.dtype, torch.Size)


def _check_plain(value: object, where: str) -> None:
    """Commits hold tensors and plain data only (they are read back with ``weights_only``,
    so a commit can never run code): refuse anything else, naming where it is."""
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
        """What a commit must match to be read back at all (e.g. a TP/PP grid)."""
        return {}

    @abc.abstractmethod
    def _read(self, replicated: dict, mine: dict | None) -> None:
        """Take the committed state: ``replicated`` (rank 0's file) and ``mine`` (this rank's,
        None for a rank the commit's job did not have), then restore it."""

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
        try:
            if record.get("layout", {}) != self._layout():
                raise ElasticError(f"commit {record['commit']} was made with layout {record.get('layout')}, this "
                                   f"launch has {self._layout()}: a state sharded over a TP/PP grid restores "
                                   "only on the same grid (keep --min-np and --max-np at its size)")
            replicated = self._store.load(record, REPLICATED)
            name = rank_file(runtime.rank())
            mine = self._store.load(record, name) if name in record["files"] else None
        except Exception as exc:
            failure = f"rank {runtime.rank()}: {exc}"
        errors = [error for error in functions.allgather_object(failure, name="psrt.elastic.resume.read") if error]
        if errors:
            raise ElasticError(f"cannot resume from commit {record['commit']}: {'; '.join(errors)}")
        self._commit_number = self.restored_from = record["commit"]
        self._read(replicated, mine)
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

    def _read(self, replicated: dict, mine: dict | None) -> None:
        self._saved_state = replicated["objects"]
        self.restore()


class _Rng:
    """This rank's random number generators: Python's, NumPy's and torch's (CPU, and CUDA's
    once CUDA is in use).  Each rank keeps its own; a rank of a larger relaunch that had
    no counterpart keeps the generators it started with."""

    @staticmethod
    def capture() -> dict:
        kind, keys, position, has_gauss, gauss = np.random.get_state()
        state = {"python": random.getstate(), "torch": torch.get_rng_state(),
                 "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss]}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    @staticmethod
    def apply(state: dict) -> None:
        random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
        kind, keys, position, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class TorchState(ObjectState):
    """Horovod's ``hvd.elastic.TorchState(model=None, optimizer=None, **kwargs)``: the model,
    the optimizer (its state, including what torch creates at the first step), every
    :class:`ElasticSampler` among the keywords, each rank's RNG states, and the other
    keywords as plain values.

    ``optimizer`` may be a ``psrt.torch.DistributedOptimizer`` or plain torch optimizer
    (replicated: committed once), a ``psrt.zero.ZeroOptimizer`` (its sharded checkpoint,
    which holds the model too, and loads at any size) or a ``psrt.ps.DistributedOptimizer``
    (the servers' checkpoint; the model is pulled back from the servers).  ``grid``
    (psrt's addition) says the model is a TP/PP stage: model and optimizer are then
    committed per rank, agree over ``grid.dp_set``, and restore on the same grid only.
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
        self._kind = _optimizer_kind(optimizer)
        self._process_set: ProcessSet = grid.dp_set if grid is not None else global_process_set
        self._copies: dict = {}
        self.save()

    def _owns_model(self) -> bool:
        """Whether the model's values are committed here (a ZeRO or PS optimizer keeps them)."""
        return self.model is not None and self._kind == "torch"

    def save(self) -> None:
        super().save()
        copies = {"rng": _Rng.capture(),
                  "samplers": {name: sampler.state_dict() for name, sampler in self.samplers.items()}}
        if self._owns_model():
            copies["model"] = {key: value.detach().clone() for key, value in self.model.state_dict().items()}
        if self.optimizer is not None and self._kind == "torch":
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
        if self._kind in ("zero", "ps") and self._commit_number:
            self.optimizer.load(os.path.join(self._store.directory(self._commit_number), self._kind))

    def sync(self) -> None:
        """Make every rank hold rank 0's state (the model and optimizer over ``grid.dp_set`` with a
        grid).

        Collective: every rank of the world calls it, in the same order.
        """
        root = self.grid.runtime.topology.ranks_of(self._process_set)[0] if self.grid is not None else 0
        if self._owns_model():
            functions.broadcast_parameters(self.model.state_dict(), root, process_set=self._process_set)
        if self.optimizer is not None and self._kind == "torch":
            functions.broadcast_optimizer_state(self.optimizer, root, model=self.model,
                                                process_set=self._process_set)
        for name, sampler in self.samplers.items():  # rank 0's position, as Horovod, and every rank's marks
            states = functions.allgather_object(sampler.state_dict(), name=f"psrt.elastic.sampler.{name}")
            sampler.load_state_dict(dict(states[0], processed=torch.stack([s["processed"] for s in states]).any(dim=0)))
        ObjectState.sync(self)
        self.save()

    def _write_collective(self, directory: str) -> None:
        if self._kind in ("zero", "ps"):
            self.optimizer.save(os.path.join(directory, self._kind))

    def _replicated_document(self) -> dict:
        document = dict(super()._replicated_document(), samplers=self._copies["samplers"])
        if self.grid is None:
            document.update({key: self._copies[key] for key in ("model", "optimizer") if key in self._copies})
        return document

    def _rank_document(self) -> dict:
        document = {"rng": self._copies["rng"]}
        if self.grid is not None:
            document.update({key: self._copies[key] for key in ("model", "optimizer") if key in self._copies})
        return document

    def _layout(self) -> dict:
        if self.grid is None:
            return {}
        shape = self.grid.shape
        return {"size": runtime.size(),
                "grid": {"dp": shape.dp, "tp": shape.tp, "pp": shape.pp, "cp": shape.cp, "ep": shape.ep}}

    def _read(self, replicated: dict, mine: dict | None) -> None:
        held = replicated if self.grid is None else (mine or {})
        self._saved_state = replicated["objects"]
        self._copies = {"rng": mine["rng"] if mine is not None else _Rng.capture(),
                        "samplers": replicated["samplers"],
                        **{key: held[key] for key in ("model", "optimizer") if key in held}}
        self.restore()  # ZeRO and PS optimizers load the commit's own checkpoint here


def _optimizer_kind(optimizer) -> str:
    """How an optimizer's state is committed: "torch" (its state_dict), "zero" or "ps"
    (their own sharded checkpoints)."""
    from psrt.ps.optimizer import _PsOptimizer
    from psrt.zero.optimizer import ZeroOptimizer
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer) and not isinstance(optimizer, _PsOptimizer):
        return "torch"
    if isinstance(optimizer, ZeroOptimizer):
        return "zero"
    if isinstance(optimizer, _PsOptimizer):
        return "ps"
    raise ArgumentTypeError(f"TorchState(optimizer=...) takes a torch optimizer, a psrt DistributedOptimizer, "
                            f"ZeroOptimizer or parameter-server DistributedOptimizer, got {type(optimizer).__name__}")
