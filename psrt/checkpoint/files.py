"""Checkpoint files that are written whole and read back only if they are what was saved:
psrt's one checkpoint writer and reader.

Every checkpoint psrt writes (the parameter servers', ZeRO's, elastic commits,
``save_pretrained`` and ``psrt zero-to-full``) follows one rule.  Its tensor files are
written with :func:`save_tensors` (a document of tensors and plain data) or
:func:`write_safetensors` (named tensors, as Hugging Face's files hold): under a temporary
name, fsynced, renamed, and the directory fsynced, so that a crash leaves the old file or the
new one, never half of one.  Each returns the file's size and sha256, which go into the
checkpoint's commit record (the PS ``manifest.json``, the ZeRO ``zero_meta.json``, the
elastic ``latest.json``, the Hugging Face index), written last with :func:`write_json`, the
same way.  :func:`load_tensors` and :func:`open_tensors` compare a file with its record
before reading anything in it: a damaged, truncated or swapped file is refused with the file
named and what is wrong with it.  Tensors are read with
:class:`~psrt.checkpoint.safetensors_reader.SafetensorsReader`, which validates the header
and reads only the bytes asked for, so a rank can take slices of a file (its own shard of
another layout's) without holding the rest.

The files are safetensors files (:mod:`psrt.checkpoint.document` says how a document's
structure travels in their metadata, as JSON): nothing in them is pickled, so a crafted
file can never run code, even when its commit record was rewritten to match.  Files that
psrt wrote before (``torch.save`` zip archives; the names stay ``*.pt``) are still read,
with ``torch.load(weights_only=True)``, which unpickles tensors and plain data only.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import zipfile
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from psrt.checkpoint import document as checkpoint_document
from psrt.checkpoint.safetensors_reader import SafetensorsReader
from psrt.errors import PsrtError

_CHUNK_BYTES = 1 << 18
_FIX = "restore it from a backup or save again"
FORMAT = "psrt-tensors/1"  # a file's own format, in its safetensors metadata


@dataclass(frozen=True)
class FileRecord:
    """What a checkpoint file was when it was saved."""

    size: int
    sha256: str

    def to_json(self) -> dict:
        return {"bytes": self.size, "sha256": self.sha256}


def fingerprint(path: str) -> FileRecord:
    """The size and sha256 of the file at ``path`` as it is now, read through one buffer of
    256 KiB (all a check adds to a rank's memory)."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while count := f.readinto(buffer):
            digest.update(view[:count])
            size += count
    return FileRecord(size, digest.hexdigest())


def save_tensors(document: object, path: str) -> FileRecord:
    """Write ``document`` (tensors and plain data only; anything else raises ``TypeError``
    naming where it is) to ``path`` as a safetensors file, so that a crash never leaves half
    a file under that name; returns the record to keep in the commit record."""
    tensors, skeleton = checkpoint_document.encode(document)
    return write_safetensors(tensors, path, {"format": FORMAT, "document": skeleton})


def write_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None
                      ) -> FileRecord:
    """Write ``tensors`` (host, contiguous, sharing no memory) to ``path`` as a safetensors
    file with ``metadata``: whole or not at all, on disk with its directory entry before this
    returns; returns the file's size and sha256 for the commit record."""
    save_file(tensors, path + ".tmp", metadata=metadata)
    fsync(path + ".tmp")  # on disk before the rename makes it the file
    record = fingerprint(path + ".tmp")
    os.replace(path + ".tmp", path)
    fsync(os.path.dirname(path) or ".")  # the rename itself on disk
    return record


def fsync(path: str) -> None:
    """Make the file at ``path``, or a directory's entries (a rename in it), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(document: object, path: str) -> None:
    """Write a commit record (or other small JSON file) so that it appears whole or not at all."""
    with open(path + ".tmp", "w") as f:
        json.dump(document, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync(os.path.dirname(path) or ".")


def read_json(path: str, error: type[PsrtError]) -> dict:
    """The JSON object in ``path``; raises ``error`` naming the file and what is wrong.
    The caller says what a missing file means, so this expects one to exist."""
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except ValueError as e:  # invalid JSON or UTF-8
        raise error(f"cannot read {path}: it is damaged or was cut short (not valid JSON: {e}); "
                    f"{_FIX}") from None
    except OSError as e:
        raise error(f"cannot read {path}: {e}") from None
    if not isinstance(document, dict):
        raise error(f"{path} holds a JSON {type(document).__name__}, not the object psrt writes: {_FIX}")
    return document


def record_of(records: object, path: str, commit_record: str, error: type[PsrtError]) -> FileRecord:
    """The record ``commit_record`` holds (in ``records``: file name -> {"bytes", "sha256"})
    for the file at ``path``."""
    name = os.path.basename(path)
    entry = records.get(name) if isinstance(records, dict) else None
    try:
        return FileRecord(int(entry["bytes"]), str(entry["sha256"]))
    except (TypeError, KeyError, ValueError):
        raise error(f"{commit_record} records no size and sha256 for {name} (got {entry!r}): the "
                    f"commit record is damaged or belongs to another save; {_FIX}") from None


def load_tensors(path: str, record: FileRecord | None, error: type[PsrtError]) -> object:
    """What :func:`save_tensors` wrote to ``path`` (or, from an older psrt, ``torch.save``),
    after checking the file against ``record`` (``None``: a checkpoint from before records
    were kept, loaded unchecked); raises ``error`` naming the file and what is wrong.  Never
    runs code stored in the file."""
    check_file(path, record, error)
    if zipfile.is_zipfile(path):  # what psrt wrote before safetensors
        return _load_legacy(path, error)
    with _open_document(path, error) as (reader, skeleton):
        tensors = {name: reader.read(name) for name in reader.names()}
        return _decode(tensors, skeleton, path, error)


def open_tensors(path: str, record: FileRecord | None, error: type[PsrtError]) -> StoredDocument:
    """What :func:`save_tensors` wrote to ``path``, checked against ``record`` as
    :func:`load_tensors` does, with every tensor left in the file as a :class:`StoredTensor`
    to read whole or a block of rows at a time: a rank takes only the slices it needs.
    Close it (or use it as a context manager) when done."""
    check_file(path, record, error)
    stack = contextlib.ExitStack()
    with stack:
        reader, skeleton = stack.enter_context(_open_document(path, error))
        stored = {name: StoredTensor(reader, name) for name in reader.names()}
        document = _decode(stored, skeleton, path, error)
        return StoredDocument(document, stack.pop_all())


class StoredTensor:
    """A tensor of an open checkpoint file, read when asked for."""

    def __init__(self, reader: SafetensorsReader, name: str) -> None:
        self._reader, self._name = reader, name
        self.shape, self.dtype = reader.shape(name), reader.dtype(name)

    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, dim: int = 0, begin: int = 0, end: int | None = None, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """The whole tensor, or rows ``[begin, end)`` of dimension ``dim``; into ``out`` (a
        contiguous host tensor of that shape and dtype) when given."""
        return self._reader.read(self._name, dim, begin, end, out)


class StoredDocument:
    """A checkpoint file's document whose tensors are :class:`StoredTensor` s, while open."""

    def __init__(self, document: object, closing: contextlib.ExitStack) -> None:
        self.document, self._closing = document, closing

    def close(self) -> None:
        self._closing.close()

    def __enter__(self) -> StoredDocument:
        return self

    def __exit__(self, *_) -> None:
        self.close()


@contextlib.contextmanager
def _open_document(path: str, error: type[PsrtError]):
    """The file's validated reader and its document's JSON skeleton."""
    with SafetensorsReader(path, error) as reader:
        metadata = reader.metadata()
        if metadata.get("format") != FORMAT or "document" not in metadata:
            raise error(f"{path} cannot be loaded as a psrt checkpoint file: its metadata names format "
                        f"{metadata.get('format')!r}, not {FORMAT!r}; {_FIX}")
        yield reader, metadata["document"]


def _decode(tensors: dict, skeleton: str, path: str, error: type[PsrtError]) -> object:
    try:
        return checkpoint_document.decode(tensors, skeleton)
    except (ValueError, KeyError, TypeError) as e:
        raise error(f"{path} cannot be loaded as a psrt checkpoint file ({type(e).__name__}: {e}); nothing in it "
                    f"was run. The file is damaged or was not written by psrt: {_FIX}") from None


def _load_legacy(path: str, error: type[PsrtError]) -> object:
    """A file psrt wrote with ``torch.save``, unpickled with ``weights_only``."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # whatever the file holds, the caller gets the file's name and a reason
        raise error(f"{path} cannot be loaded as a psrt checkpoint file ({_reason(e)}); it was refused "
                    "without running anything in it. psrt saves only tensors and plain data, so the "
                    f"file is damaged or was not written by psrt: {_FIX}") from None


def check_file(path: str, record: FileRecord | None, error: type[PsrtError]) -> None:
    """Refuse (raising ``error`` naming the file) a file that is missing, empty, or, against
    ``record``, of another size or sha256."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise error(f"{path} is missing: {_FIX}") from None
    except OSError as e:
        raise error(f"cannot read {path}: {e}") from None
    if size == 0:
        raise error(f"{path} is empty (0 bytes): the save that wrote it did not finish, or the file "
                    f"was truncated; {_FIX}")
    if record is None:
        return
    if size != record.size:
        raise error(f"{path} has {size} bytes, {record.size} were saved: it was cut short after it was "
                    f"saved, or belongs to another save; {_FIX}")
    try:
        actual = fingerprint(path).sha256
    except OSError as e:
        raise error(f"cannot read {path}: {e}") from None
    if actual != record.sha256:
        raise error(f"{path} was modified after it was saved, or belongs to another save (sha256 "
                    f"mismatch: {actual[:16]}… instead of {record.sha256[:16]}…): {_FIX}")


def _reason(exc: Exception) -> str:
    """torch's own reason for refusing a file, without its advice to load it unsafely."""
    paragraphs = [p.strip() for p in str(exc).split("\n\n") if p.strip()]
    kept = [p for p in paragraphs if "weights_only" not in p and "Weights only load failed" not in p]
    return f"{type(exc).__name__}: {' '.join(kept)}" if kept else type(exc).__name__
