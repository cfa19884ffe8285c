"""Horovod's elastic state objects ``State`` and ``ObjectState``: how any state is kept,
committed and resumed.

``commit()`` keeps a copy in memory (``restore()`` goes back to it, as in Horovod) and,
under ``psrun --min-np/--max-np``, writes it to the job's commit directory
(:mod:`psrt.elastic.commits`) so that a relaunched job starts from it: replicated state
once (rank 0), each rank's own state per rank, and what a state writes collectively
(sharded optimizers' own checkpoints), which a job of another size loads.  A subclass says
what goes into each part; the model's and optimizer's state, ``TorchState``, is
:mod:`psrt.elastic.torch_state`'s.
"""
from __future__ import annotations

import abc
import copy
import os

import torch

from launcher.contract import ENV_ELASTIC_HOSTS_VERSION
from psrt import runtime
from psrt.elastic.commits import REPLICATED, CommitStore, rank_file
from psrt.errors import ElasticError, HostsUpdatedInterrupt
from psrt.torch import functions

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
        self._launch_hosts_version = int(os.environ.get(ENV_ELASTIC_HOSTS_VERSION, "0"))
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
