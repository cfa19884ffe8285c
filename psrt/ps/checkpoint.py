"""Saving and restoring the servers' shards: one file per server in a directory.

Each file holds, for every KVStore on that server, each chunk's value,
optimizer state and clocks, and the id of the save that wrote it; worker 0
writes ``manifest.json`` with that id and each file's size and sha256 (which
the servers' save replies carry) once every server has saved, so a save that
crashed halfway is never taken for a checkpoint.  A job restarted with the
same number of servers (and the same keys, initialised in the same order, and
the same optimizer) restores every chunk in place.  Loading checks every
server's file first (against the manifest before reading anything; the files
are safetensors, so none can run code, and those of earlier psrt, ``torch.save``
archives, are read with ``weights_only``) and restores only if all of them are
right; anything else is refused with the file and the reason, before anything is
changed.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from psrt.checkpoint import files as checkpoint_files
from psrt.errors import ParameterServerError

if TYPE_CHECKING:
    from psrt.ps.store import Store

FORMAT = "psrt-ps-checkpoint-3"  # safetensors files
# Written by earlier psrt, whose files are torch.save archives (still read, with weights_only):
TORCH_FILES_FORMAT = "psrt-ps-checkpoint-2"
# Written before the manifest recorded each file's size and sha256: still loaded (with
# weights_only, as every file), without the check against the manifest.
UNCHECKED_FORMAT = "psrt-ps-checkpoint-1"
MANIFEST = "manifest.json"


def server_file(path: str, index: int, num_servers: int) -> str:
    return os.path.join(path, f"server-{index}-of-{num_servers}.pt")


def write_manifest(path: str, save_id: str, num_servers: int, files: dict[str, dict] | None = None,
                   extra: dict | None = None) -> None:
    """Make the save ``save_id`` the checkpoint in ``path``.  ``files``: the records the servers'
    saves returned; a server's file without one is refused at load.  ``extra``: the caller's own
    values, given back at load."""
    checkpoint_files.write_json({"format": FORMAT, "save_id": save_id, "num_servers": num_servers,
                                 "files": files or {}, "extra": extra}, os.path.join(path, MANIFEST))


def read_manifest(path: str) -> dict | str:
    """The manifest of the last finished save in ``path``, or why there is none (a string,
    so that worker 0 can hand the reason to every worker: this never raises)."""
    target = os.path.join(path, MANIFEST)
    if not os.path.exists(target):
        return f"no finished parameter-server checkpoint in {path!r} ({MANIFEST} is missing)"
    try:
        manifest = checkpoint_files.read_json(target, ParameterServerError)
    except ParameterServerError as e:
        return str(e)
    if manifest.get("format") not in (FORMAT, TORCH_FILES_FORMAT, UNCHECKED_FORMAT):
        return f"{target} is not a psrt parameter-server manifest (format {manifest.get('format')!r})"
    if not isinstance(manifest.get("save_id"), str) or (
            manifest["format"] != UNCHECKED_FORMAT and not isinstance(manifest.get("files"), dict)):
        return f"{target} is damaged (no save id or no file records): restore it from a backup or save again"
    return manifest


def save_server(path: str, index: int, num_servers: int, stores: dict[int, Store], save_id: str) -> dict:
    """Write this server's file of save ``save_id``; returns {file name: its record} for the manifest."""
    os.makedirs(path, exist_ok=True)
    document = {"format": FORMAT, "num_servers": num_servers, "save_id": save_id, "stores": {
        store_id: {"settings": list(store.settings),
                   "optimizer": None if store.optimizer is None else
                   [store.optimizer.name, store.optimizer.hyperparameters],
                   "shards": {chunk_id: shard.state() for chunk_id, shard in store.shards.items()}}
        for store_id, store in stores.items()}}
    target = server_file(path, index, num_servers)
    record = checkpoint_files.save_tensors(document, target)  # a crash mid-save leaves the previous file
    return {os.path.basename(target): record.to_json()}


def load_server(path: str, index: int, num_servers: int, stores: dict[int, Store], save_id: str,
                restore: bool = True, *, files: dict | None = None) -> dict:
    """Check this server's file of save ``save_id`` in ``path`` against its record in the
    manifest's ``files`` (None only for a manifest of :data:`UNCHECKED_FORMAT`) and against
    ``stores`` and, with ``restore``, restore every chunk from it; returns
    {"steps": {store: steps or None}}."""
    target = server_file(path, index, num_servers)
    if not os.path.exists(target):
        found = sorted(f for f in os.listdir(path) if f.startswith("server-")) if os.path.isdir(path) else []
        raise ParameterServerError(f"no checkpoint for server {index} of {num_servers} in {path!r}: {target} "
                                   "is missing" + (f" (found {found}: saved with another number of servers?)"
                                                   if found else ""))
    record = None if files is None else checkpoint_files.record_of(
        files, target, os.path.join(path, MANIFEST), ParameterServerError)
    document = checkpoint_files.load_tensors(target, record, ParameterServerError)
    if not isinstance(document, dict) or document.get("format") not in (FORMAT, TORCH_FILES_FORMAT, UNCHECKED_FORMAT):
        raise ParameterServerError(f"{target} is not a psrt parameter-server checkpoint")
    if document.get("save_id") != save_id:
        raise ParameterServerError(f"{target} was written by another save than the one {MANIFEST} "
                                   "names (a save that did not finish?)")
    try:
        _check_layout(document, stores, target)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise ParameterServerError(f"{target} is damaged: it lacks what a psrt parameter-server checkpoint "
                                   f"holds ({type(e).__name__}: {e}); restore it from a backup or save "
                                   "again") from None
    if not restore:
        return {}
    for store_id, store in stores.items():
        saved = document["stores"][store_id]
        for chunk_id, shard in store.shards.items():
            shard.restore(saved["shards"][chunk_id])
    # a server holding no chunk of a store has no say in its step count
    return {"steps": {store_id: min((min(s.applied) for s in store.shards.values()), default=None)
                      for store_id, store in stores.items()}}


def _check_layout(document: dict, stores: dict[int, Store], target: str) -> None:
    for store_id, store in stores.items():
        saved = document["stores"].get(store_id)
        if saved is None:
            raise ParameterServerError(f"{target} has no KVStore {store_id}")
        saved_optimizer = saved["optimizer"][0] if saved["optimizer"] else None
        optimizer = store.optimizer.name if store.optimizer else None
        if saved_optimizer != optimizer:
            raise ParameterServerError(f"{target}: KVStore {store_id} was saved with optimizer "
                                       f"{saved_optimizer}, this job set {optimizer}")
        if tuple(saved["settings"]) != store.settings:
            raise ParameterServerError(f"{target}: KVStore {store_id} was saved with settings "
                                       f"{saved['settings']}, this job uses {list(store.settings)}")
        if set(saved["shards"]) != set(store.shards):
            raise ParameterServerError(f"{target}: KVStore {store_id} holds chunks "
                                       f"{sorted(saved['shards'])}, this job {sorted(store.shards)}")
        for chunk_id, shard in store.shards.items():
            state = saved["shards"][chunk_id]
            mine = (shard.meta.key, shard.meta.offset, shard.meta.numel, list(shard.meta.shape),
                    str(shard.meta.dtype))
            theirs = (state["key"], state["offset"], state["numel"], state["shape"], state["dtype"])
            if mine != theirs:
                raise ParameterServerError(f"{target}: chunk {chunk_id} was saved as {theirs}, this "
                                           f"job has {mine} (a checkpoint of a different model?)")
            if (state["optimizer"] is not None) != (shard.optimizer is not None):
                raise ParameterServerError(f"{target}: chunk {chunk_id} was saved "
                                           f"{'with' if state['optimizer'] else 'without'} optimizer "
                                           "state; call set_optimizer() the same way before load()")
