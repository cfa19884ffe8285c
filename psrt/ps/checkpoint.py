"""Saving and restoring the servers' shards: one file per server in a directory.

Each file holds, for every KVStore on that server, each chunk's value,
optimizer state and clocks, and the id of the save that wrote it; worker 0
writes ``manifest.json`` with that id once every server has saved, so a save
that crashed halfway is never taken for a checkpoint.  A job restarted with
the same number of servers (and the same keys, initialised in the same order,
and the same optimizer) restores every chunk in place.  Loading checks every
server's file first and restores only if all of them are right; anything
else is refused with the reason, before anything is changed.
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch

from psrt.errors import ParameterServerError

if TYPE_CHECKING:
    from psrt.ps.store import Store

FORMAT = "psrt-ps-checkpoint-1"
MANIFEST = "manifest.json"


def server_file(path: str, index: int, num_servers: int) -> str:
    return os.path.join(path, f"server-{index}-of-{num_servers}.pt")


def write_manifest(path: str, save_id: str, num_servers: int) -> None:
    target = os.path.join(path, MANIFEST)
    with open(target + ".tmp", "w") as f:
        json.dump({"format": FORMAT, "save_id": save_id, "num_servers": num_servers}, f)
    os.replace(target + ".tmp", target)


def read_manifest(path: str) -> dict | str:
    """The manifest of the last finished save in ``path``, or why there is none (a string,
    so that worker 0 can hand the reason to every worker)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return f"no finished parameter-server checkpoint in {path!r} ({MANIFEST} is missing)"
    except (OSError, ValueError) as e:
        return f"cannot read {os.path.join(path, MANIFEST)}: {e}"
    if manifest.get("format") != FORMAT:
        return f"{os.path.join(path, MANIFEST)} is not a psrt parameter-server manifest"
    return manifest


def save_server(path: str, index: int, num_servers: int, stores: dict[int, Store], save_id: str) -> None:
    os.makedirs(path, exist_ok=True)
    document = {"format": FORMAT, "num_servers": num_servers, "save_id": save_id, "stores": {
        store_id: {"settings": list(store.settings),
                   "optimizer": None if store.optimizer is None else
                   [store.optimizer.name, store.optimizer.hyperparameters],
                   "shards": {chunk_id: shard.state() for chunk_id, shard in store.shards.items()}}
        for store_id, store in stores.items()}}
    target = server_file(path, index, num_servers)
    torch.save(document, target + ".tmp")
    os.replace(target + ".tmp", target)  # a crash mid-save leaves the previous checkpoint


def load_server(path: str, index: int, num_servers: int, stores: dict[int, Store], save_id: str,
                restore: bool = True) -> dict:
    """Check this server's file of save ``save_id`` in ``path`` against ``stores`` and, with
    ``restore``, restore every chunk from it; returns {"steps": {store: steps or None}}."""
    target = server_file(path, index, num_servers)
    if not os.path.exists(target):
        found = sorted(f for f in os.listdir(path) if f.startswith("server-")) if os.path.isdir(path) else []
        raise ParameterServerError(f"no checkpoint for server {index} of {num_servers} in {path!r}"
                                   + (f" (found {found}: saved with another number of servers?)"
                                      if found else ""))
    document = torch.load(target, weights_only=False)
    if document.get("format") != FORMAT:
        raise ParameterServerError(f"{target} is not a psrt parameter-server checkpoint")
    if document["save_id"] != save_id:
        raise ParameterServerError(f"{target} was written by another save than the one {MANIFEST} "
                                   "names (a save that did not finish?)")
    _check_layout(document, stores, target)
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
