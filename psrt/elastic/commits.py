"""Where committed state lives between launches of an elastic job.

An MPI job cannot shrink or grow in place, so ``psrun`` relaunches it, and a commit must
outlive the processes that made it: it is written to the directory psrun names in
``PSRT_ELASTIC_DIR`` (a filesystem every host sees, as for any checkpoint)::

    commit-000007/       what commit 7 wrote: replicated.pt (rank 0 only: the replicated
                         state; for a TP x PP model, the index of its blocks' files),
                         model-ppPPP-tpTTT-epEEE.pt (a TP x PP model's blocks, each written
                         once, by its first data-parallel rank), rank-00003.pt (each rank's
                         own: RNG states), and the sharded optimizers' own checkpoints (zero/,
                         ps/); the .pt files are safetensors files (psrt.checkpoint.files)
    latest.json          {"commit": 7, "size": 3, ...}: written by rank 0 once every rank has
                         finished commit 7, after which the commit it replaces is removed

A commit is the moment ``latest.json`` names it.  A job killed before that keeps the
previous commit, whose directory is only removed once the pointer has moved.  The pointer
is written before anything else (naming commit 0, none, in a new directory), and it alone
holds the checksums that say a commit is whole: so a directory with commit directories but
no valid pointer lost it to something outside psrt, and is refused, naming what it holds,
rather than guessed at.  A job removes only the commit its new one replaces (one it wrote or
resumed from), never another directory it finds here.  Without ``PSRT_ELASTIC_DIR`` (a
script run by plain ``mpirun``) commits live in memory only, as in Horovod, and nothing
survives the job.

psrun also writes ``hosts.json`` here when host discovery changes; a job that stops to be
relaunched on new hosts leaves ``reset.json`` saying why, and one that cannot restore its
commit leaves ``restore-failed.json``, so that psrun stops relaunching a commit that fails
the same way every time (those names, and the variables, are :mod:`launcher.contract`'s).
"""
from __future__ import annotations

import contextlib
import os
import shutil

from launcher.contract import ENV_ELASTIC_DIR, HOSTS_FILE, RESET_FILE, RESTORE_FAILED_FILE
from psrt.checkpoint import files as checkpoint_files
from psrt.errors import ElasticError

FORMAT = "psrt-elastic/3"  # safetensors files; a TP x PP model committed as each rank's own blocks
WHOLE_MODEL_FORMAT = "psrt-elastic/2"  # earlier psrt's: a TP x PP model committed whole (still read)
TORCH_FILES_FORMAT = "psrt-elastic/1"  # earlier psrt's: torch.save files (read with weights_only)
LATEST = "latest.json"
REPLICATED = "replicated.pt"
_COMMIT_PREFIX = "commit-"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


class CommitStore:
    """The commit directory of this job (``root`` None: commits stay in memory)."""

    def __init__(self, root: str | None) -> None:
        self.root = root

    @classmethod
    def from_env(cls) -> CommitStore:
        return cls(os.environ.get(ENV_ELASTIC_DIR) or None)

    def directory(self, number: int) -> str:
        assert self.root is not None
        return os.path.join(self.root, f"{_COMMIT_PREFIX}{number:06d}")

    def commits_found(self) -> list[str]:
        """The names of the commit directories in the directory, oldest first."""
        if self.root is None or not os.path.isdir(self.root):
            return []
        return sorted(name for name in os.listdir(self.root)
                      if name.startswith(_COMMIT_PREFIX) and os.path.isdir(os.path.join(self.root, name)))

    def latest(self) -> dict | None:
        """The record of the last finished commit, or None when there is none.  Raises
        :class:`ElasticError` naming the commit directories found when the pointer is missing
        beside them, damaged, or not psrt's."""
        if self.root is None:
            return None
        path = os.path.join(self.root, LATEST)
        if not os.path.exists(path):
            if self.commits_found():
                raise ElasticError(f"{self.root} holds {self._found()} but no {LATEST}, the pointer that names "
                                   "the last finished commit and holds the checksums that prove it whole (it was "
                                   f"removed or never copied): nothing was resumed or removed. To resume, put back "
                                   f"{LATEST}; to start afresh, move the commit directories away or choose another "
                                   "--elastic-dir")
            return None
        try:
            record = checkpoint_files.read_json(path, ElasticError)
        except ElasticError as exc:
            raise ElasticError(f"{exc} ({self.root} holds {self._found()}; nothing was resumed or removed)") \
                from None
        if record.get("format") not in (FORMAT, WHOLE_MODEL_FORMAT, TORCH_FILES_FORMAT) or not isinstance(record.get("commit"), int) \
                or not isinstance(record.get("files"), dict):
            raise ElasticError(f"{path} is not a psrt elastic commit record (format {record.get('format')!r}): "
                               f"the directory belongs to something else ({self._found()}); point --elastic-dir "
                               "elsewhere")
        return record if record["commit"] > 0 else None

    def _found(self) -> str:
        found = self.commits_found()
        return f"commit directories {', '.join(found)}" if found else "no commit directories"

    def start(self) -> None:
        """Write the pointer of a job that has committed nothing yet (rank 0, when
        :meth:`latest` found no pointer and no commits), before any commit directory exists:
        from then on a directory with commits always has a pointer."""
        if self.root is None:
            return
        os.makedirs(self.root, exist_ok=True)
        checkpoint_files.write_json({"format": FORMAT, "commit": 0, "files": {}}, os.path.join(self.root, LATEST))

    def begin(self, number: int) -> str:
        """The directory for commit ``number``, created.  A directory left by a commit that
        was killed before it finished may exist: its files are overwritten."""
        path = self.directory(number)
        os.makedirs(path, exist_ok=True)
        return path

    def publish(self, record: dict, replaces: int) -> None:
        """Make ``record`` (its ``commit`` number, ``size`` and ``files``) the last commit, then
        remove the directory of commit ``replaces`` (the one this job wrote or resumed from
        last; 0 for none).  No other directory is touched."""
        assert self.root is not None
        checkpoint_files.write_json(dict(record, format=FORMAT), os.path.join(self.root, LATEST))
        if 0 < replaces != record["commit"]:
            shutil.rmtree(self.directory(replaces), ignore_errors=True)

    def save(self, document: object, number: int, name: str) -> dict[str, dict]:
        """Write ``document`` (tensors and plain data) as ``name`` in commit ``number``; returns
        {name: its size and sha256} for the commit record."""
        path = os.path.join(self.directory(number), name)
        return {name: checkpoint_files.save_tensors(document, path).to_json()}

    def load(self, record: dict, name: str) -> object:
        """File ``name`` of the commit ``record`` names, checked against the record first."""
        directory = self.directory(record["commit"])
        path = os.path.join(directory, name)
        expected = checkpoint_files.record_of(record["files"], path, os.path.join(self.root or "", LATEST),
                                              ElasticError)
        return checkpoint_files.load_tensors(path, expected, ElasticError)

    def hosts_version(self) -> int:
        """The version of the host list psrun last wrote (0 before any change)."""
        if self.root is None:
            return 0
        path = os.path.join(self.root, HOSTS_FILE)
        if not os.path.exists(path):
            return 0
        return int(checkpoint_files.read_json(path, ElasticError).get("version", 0))

    def report_restore_failure(self, reason: str) -> None:
        """Tell psrun why this launch could not restore its commit (rank 0): a relaunch that
        fails the same way is not tried again.  Advice only: a directory that cannot take it
        must not hide the restore's own error."""
        if self.root is not None:
            with contextlib.suppress(OSError):
                checkpoint_files.write_json({"reason": reason}, os.path.join(self.root, RESTORE_FAILED_FILE))

    def request_reset(self, reason: str) -> None:
        """Tell psrun that this job ended to be relaunched (not because training finished)."""
        if self.root is not None:
            checkpoint_files.write_json({"reason": reason}, os.path.join(self.root, RESET_FILE))
