"""Where committed state lives between launches of an elastic job.

An MPI job cannot shrink or grow in place, so ``psrun`` relaunches it, and a commit must
outlive the processes that made it: it is written to the directory psrun names in
``PSRT_ELASTIC_DIR`` (a filesystem every host sees, as for any checkpoint)::

    commit-000007/       what commit 7 wrote: replicated.pt (rank 0 only), rank-00003.pt
                         (each rank's own: RNG states, and a sharded model's pieces), and the
                         sharded optimizers' own checkpoints (zero/, ps/)
    latest.json          {"commit": 7, "size": 3, ...}: written by rank 0 once every rank has
                         finished commit 7, after which older commit directories are removed

A commit is the moment ``latest.json`` names it.  A job killed before that keeps the
previous commit, whose directory is only removed once the pointer has moved.  Without
``PSRT_ELASTIC_DIR`` (a script run by plain ``mpirun``) commits live in memory only, as in
Horovod, and nothing survives the job.

psrun also writes ``hosts.json`` here when host discovery changes, and a job that stops to
be relaunched on new hosts leaves ``reset.json`` saying why.
"""
from __future__ import annotations

import os
import shutil

from psrt import checkpoint_files
from psrt.errors import ElasticError

ENV_DIR = "PSRT_ELASTIC_DIR"
ENV_HOSTS_VERSION = "PSRT_ELASTIC_HOSTS_VERSION"
FORMAT = "psrt-elastic/1"
LATEST = "latest.json"
HOSTS = "hosts.json"
RESET = "reset.json"
REPLICATED = "replicated.pt"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


class CommitStore:
    """The commit directory of this job (``root`` None: commits stay in memory)."""

    def __init__(self, root: str | None) -> None:
        self.root = root

    @classmethod
    def from_env(cls) -> CommitStore:
        return cls(os.environ.get(ENV_DIR) or None)

    def directory(self, number: int) -> str:
        assert self.root is not None
        return os.path.join(self.root, f"commit-{number:06d}")

    def latest(self) -> dict | None:
        """The record of the last finished commit, or None when there is none."""
        if self.root is None:
            return None
        path = os.path.join(self.root, LATEST)
        if not os.path.exists(path):
            return None
        record = checkpoint_files.read_json(path, ElasticError)
        if record.get("format") != FORMAT or not isinstance(record.get("commit"), int) \
                or not isinstance(record.get("files"), dict):
            raise ElasticError(f"{path} is not a psrt elastic commit record (format {record.get('format')!r}): "
                               "the directory belongs to something else; point --elastic-dir elsewhere")
        return record

    def begin(self, number: int) -> str:
        """The directory for commit ``number``, created.  A directory left by a commit that
        was killed before it finished may exist: its files are overwritten."""
        path = self.directory(number)
        os.makedirs(path, exist_ok=True)
        return path

    def publish(self, record: dict) -> None:
        """Make ``record`` (its ``commit`` number, ``size`` and ``files``) the last commit, then
        remove the directories of the commits before it."""
        assert self.root is not None
        checkpoint_files.write_json(dict(record, format=FORMAT), os.path.join(self.root, LATEST))
        for name in os.listdir(self.root):
            if name.startswith("commit-") and name != os.path.basename(self.directory(record["commit"])):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)

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
        path = os.path.join(self.root, HOSTS)
        if not os.path.exists(path):
            return 0
        return int(checkpoint_files.read_json(path, ElasticError).get("version", 0))

    def request_reset(self, reason: str) -> None:
        """Tell psrun that this job ended to be relaunched (not because training finished)."""
        if self.root is not None:
            checkpoint_files.write_json({"reason": reason}, os.path.join(self.root, RESET))
