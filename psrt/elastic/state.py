"""Horovod's elastic state objects ``State`` and ``ObjectState``: how any state is kept,
committed and resumed.

``commit()`` keeps a copy in memory (``restore()`` goes back to it, as in Horovod) and,
under ``psrun --min-np/--max-np``, writes it to the job's commit directory
(:mod:`psrt.elastic.commits`) so that a relaunched job starts from it: replicated state
once (rank 0), each rank's own state per rank, and what a state writes collectively
(sharded optimizers' own checkpoints), which a job of another size loads; with
``commit(background=True)`` a thread writes the files (:mod:`psrt.background_save`).  A
subclass says what goes into each part; the model's and optimizer's state, ``TorchState``, is
:mod:`psrt.elastic.torch_state`'s.
"""
from __future__ import annotations

import abc
import copy
import os

import torch

from launcher.contract import ENV_ELASTIC_HOSTS_VERSION
from psrt import runtime
from psrt.background_save import SaveHandle, saver_of, write_then_publish
from psrt.elastic.commits import REPLICATED, CommitStore, rank_file
from psrt.errors import ElasticError, HostsUpdatedInterrupt
from psrt.torch import functions

_PLAIN = (bool, int, float, str, bytes, type(None), torch.Tensor, torch.dtype, torch.Size)


def _exchange(value: object, what: str) -> list:
    """What every rank of the world passed, for a synchronous commit (on the engine)."""
    return functions.allgather_object(value, name=f"psrt.elastic.commit.{what}")


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
        self._in_flight: tuple[SaveHandle, int] | None = None  # a background commit and its number
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

    def commit(self, background: bool = False) -> SaveHandle | None:
        """Keep the state as it is now: a later ``restore()``, or a relaunch after a failure,
        comes back here.  Then raises :class:`HostsUpdatedInterrupt` on every rank if the hosts
        changed.

        With ``background=True`` (psrt's addition, as torch DCP's ``async_save``) the commit is
        written to the commit directory by a thread (:mod:`psrt.background_save`): it returns
        once ``save()`` has copied the state, with a handle whose ``wait()`` blocks until the
        commit is written.  Until then a relaunch resumes from the previous commit.  The next
        commit, :meth:`wait` or ``shutdown()`` waits for it first and raises its error
        (:class:`ElasticError`, on every rank) unless the handle did.  What a state writes
        collectively (a sharded optimizer's own checkpoint, a TP x PP model's blocks)
        is still written before it returns.  Without a commit directory the handle is done.

        Collective: every rank of the world calls it, in the same order, with the same
        ``background``.
        """
        self.wait()
        self.save()
        handle = None
        if self._store.root is not None:
            handle = self._persist(background)
        self.check_host_updates()
        return (handle or SaveHandle(None)) if background else None

    def wait(self) -> None:
        """Wait for the background commit in flight, if any (psrt's addition); raises its
        :class:`ElasticError` unless its handle already did.  Every rank raises alike (the
        ranks agreed on the outcome), but this is not a collective call."""
        self._settle(raise_error=True)

    def _settle(self, raise_error: bool) -> None:
        """Take in the outcome of the background commit in flight, once written: its number
        becomes this process's commit; its error is raised (``raise_error``), or kept for then."""
        if self._in_flight is None:
            return
        handle, number = self._in_flight
        if handle.error() is None:
            self._committed = self._last_in_store = number
        elif not raise_error:
            return
        self._in_flight = None
        if not handle.told:
            handle.wait()

    @property
    def _commit_number(self) -> int:
        """The commit this process last wrote or resumed from (0: none).  A background commit
        counts once it is written: reading this waits for it (and leaves its error for the
        next commit or wait()), so that what restores from the commit directory reads the
        commit that ``save()``'s copies belong to."""
        self._settle(raise_error=False)
        return self._committed

    @_commit_number.setter
    def _commit_number(self, number: int) -> None:
        self._committed = number

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

    def _persist(self, background: bool) -> SaveHandle | None:
        if self._last_in_store is None:  # committing without elastic.run(): the directory is still unread
            self._open_store()
        # Numbers only grow in a directory, so a commit never lands in one this job did not write.
        number = max(self._commit_number, self._last_in_store) + 1
        directory = self._store.begin(number)
        self._write_collective(directory)  # raises on every rank together
        rank, replaces = runtime.rank(), self._commit_number
        documents = {REPLICATED: self._replicated_document()} if rank == 0 else {}
        documents[rank_file(rank)] = self._rank_document()
        record = {"commit": number, "size": runtime.size(), "layout": self._layout(),
                  "any_layout": self._restores_on_any_layout()}

        def write(documents: dict) -> dict[str, dict]:
            if REPLICATED in documents:
                _check_plain(documents[REPLICATED], "the committed state")
            files: dict[str, dict] = {}
            for name, document in documents.items():
                files.update(self._store.save(document, number, name))
            return files

        def publish(files: dict[str, dict]) -> None:
            self._store.publish(dict(record, files=files), replaces=replaces)

        def failed(errors: list[str]) -> ElasticError:
            return ElasticError(f"commit {number} failed, the previous commit stays: {'; '.join(errors)}")

        if background:  # save() made the copies for this commit alone: they are what is staged
            saver = saver_of(runtime.current(), runtime.global_process_set)
            staged = saver.stage(documents)
            handle = saver.submit(lambda: write(staged.take()), publish, failed)
            self._in_flight = handle, number
            return handle
        errors = write_then_publish(lambda: write(documents), publish, _exchange, rank)
        if errors:
            raise failed(errors)
        self._commit_number = self._last_in_store = number
        return None

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
