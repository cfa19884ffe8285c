"""Checksums for ``torch.distributed.checkpoint`` (DCP): a writer that records each data
file's size and sha256 in the checkpoint's ``.metadata``, and a reader that checks every file
a rank's load reads against them before any rank reads a tensor.

DCP alone loads a file with a flipped byte silently, whatever the backend.  Pass these to
``dcp.save`` / ``dcp.load`` in place of torch's ``FileSystemWriter`` / ``FileSystemReader``::

    dcp.save(state, storage_writer=ChecksummedWriter(path))
    dcp.load(state, storage_reader=ChecksummedReader(path))

Where the checksums live: ``.metadata`` is torch's ``Metadata`` object, pickled.  Its fields
all have owners in torch (``storage_data`` maps each tensor chunk to its place in a file, and
tools iterate it expecting just that; ``planner_data`` is the planner's), so the records are
one more attribute of that object, :data:`CHECKSUMS`, which pickling keeps and every other
reader ignores: ``{file name: {"bytes": size, "sha256": hex digest}}``.  Plain types only: torch
unpickles ``.metadata`` with plain ``pickle`` (no allow-list in torch 2.13), so a class of
psrt's there would make the checkpoint unreadable wherever psrt is not installed; as it is,
torch's own reader loads it anywhere.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from psrt.checkpoint import files
from psrt.errors import CheckpointError

__all__ = ["CHECKSUMS", "ChecksummedReader", "ChecksummedWriter"]

CHECKSUMS = "psrt_file_checksums"  # the attribute of torch's Metadata that holds the records
_FIX = "restore the checkpoint from a backup or save it again"


@dataclasses.dataclass(frozen=True)
class _FileChecksum:
    """A data file's size and sha256 on its way from the rank that wrote it to the
    coordinator, as one more ``WriteResult``; :meth:`ChecksummedWriter.finish` takes it out
    of the results before torch records them, so it never reaches ``.metadata``."""

    name: str
    size: int
    sha256: str

    def record(self) -> dict[str, Any]:
        return {"bytes": self.size, "sha256": self.sha256}


class ChecksummedWriter(FileSystemWriter):
    """torch's ``FileSystemWriter`` that also records each data file's size and sha256 in
    the checkpoint's ``.metadata`` (the attribute :data:`CHECKSUMS`), for
    :class:`ChecksummedReader` to check.  Takes ``FileSystemWriter``'s arguments.

    Each rank hashes the files it wrote (reading them back once) and, with ``sync_files``
    (the default), fsyncs their directory; the coordinator then writes ``.metadata`` as
    torch does, fsynced, and fsyncs the directory again, so the record of a file is on disk
    only after the file is.  Pass it to every rank's ``dcp.save``."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        return super().write_data(plan, planner).then(self._with_checksums)

    def _with_checksums(self, written: Future[list[WriteResult]]) -> list[WriteResult]:
        results = written.value()
        names = sorted({result.storage_data.relative_path for result in results})
        if self.sync_files:
            files.fsync(self.path)
        checksums = [_FileChecksum(name, *_size_and_sha256(self.fs.concat_path(self.path, name))) for name in names]
        return results + [WriteResult(index=MetadataIndex(f"psrt checksum of {c.name}"), size_in_bytes=0,
                                      storage_data=c) for c in checksums]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records, kept = {}, []
        for rank_results in results:
            kept.append([r for r in rank_results if not isinstance(r.storage_data, _FileChecksum)])
            records.update((r.storage_data.name, r.storage_data.record()) for r in rank_results
                           if isinstance(r.storage_data, _FileChecksum))
        setattr(metadata, CHECKSUMS, records)
        super().finish(metadata, kept)
        if self.sync_files:
            files.fsync(self.path)


class ChecksummedReader(FileSystemReader):
    """torch's ``FileSystemReader`` that checks every file this rank's load reads against the
    size and sha256 that :class:`ChecksummedWriter` recorded, before any rank reads a tensor.

    A missing, truncated, changed or swapped file (one from another save, or a ``.metadata``
    rewritten without its files) is refused with a :class:`~psrt.errors.CheckpointError`
    naming the file and what is wrong.  The check runs in DCP's planning step, whose errors
    torch gathers: every rank's ``dcp.load`` then raises torch's ``CheckpointException``
    (a ``BaseException``), which holds each failing rank's error in ``failures`` and names
    them in its message, and no rank's ``state_dict`` has changed.  Each file is read once
    more than a plain load reads it.

    A checkpoint written without checksums (by torch's ``FileSystemWriter``) is refused the
    same way unless ``allow_unverified=True``, which loads it unchecked: a reader chosen to
    verify does not skip that silently.

    Args:
        path: the checkpoint's directory, as for ``FileSystemReader``.
        allow_unverified: load a checkpoint that records no checksums, unchecked (default
            False: refuse it, naming the reason).
    """

    def __init__(self, path: str | os.PathLike, *, allow_unverified: bool = False) -> None:
        super().__init__(path)
        self.allow_unverified = allow_unverified
        self._records: object = None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._records = getattr(metadata, CHECKSUMS, None)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        names = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
        where = self._get_metadata_path(None if self.use_collectives else self.rank)
        if self._records is None:
            if not self.allow_unverified:
                raise CheckpointError(
                    f"{where} records no checksums: the checkpoint was written by torch's FileSystemWriter "
                    "(or an older psrt), not psrt.checkpoint.dcp.ChecksummedWriter, so its files cannot be "
                    "verified. Save it again with ChecksummedWriter, or pass "
                    "ChecksummedReader(path, allow_unverified=True) to load it unchecked")
        elif not isinstance(self._records, dict):
            raise CheckpointError(f"{where} holds checksums that are not a mapping of file names "
                                  f"(got {type(self._records).__name__}): it is damaged; {_FIX}")
        else:
            for name in names:
                self._verify(name, where)
        return super().prepare_local_plan(plan)

    def _verify(self, name: str, where: object) -> None:
        path = self.fs.concat_path(self.path, name)
        entry = self._records.get(name)
        try:
            size, sha256 = int(entry["bytes"]), str(entry["sha256"])
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{where} records no size and sha256 for {name} (got {entry!r}), which this "
                                  f"load reads: the .metadata was rewritten or belongs to another save; "
                                  f"{_FIX}") from None
        try:
            actual_size, actual_sha256 = _size_and_sha256(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing ({size} bytes were saved): {_FIX}") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
        if actual_size != size:
            raise CheckpointError(f"{path} has {actual_size} bytes, {size} were saved: it was cut short, or "
                                  f"belongs to another save; {_FIX}")
        if actual_sha256 != sha256:
            raise CheckpointError(f"{path} was changed after it was saved, or belongs to another save (sha256 "
                                  f"{actual_sha256[:16]}… instead of {sha256[:16]}…): {_FIX}")


def _size_and_sha256(path: str | os.PathLike) -> tuple[int, str]:
    record = files.fingerprint(str(path))
    return record.size, record.sha256
