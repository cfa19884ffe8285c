"""Saving and restoring the servers' shards: one file per server in a directory.

Each file holds, for every KVStore on that server, each chunk's value,
optimizer state and clocks.  A job restarted with the same number of servers
(and the same keys, initialised in the same order) restores every chunk in
place; anything else is refused with the reason, before anything is changed.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from psrt.errors import ParameterServerError

if TYPE_CHECKING:
    from psrt.ps.server import _Store

FORMAT = "psrt-ps-checkpoint-1"


def server_file(path: str, index: int, num_servers: int) -> str:
    return os.path.join(path, f"server-{index}-of-{num_servers}.pt")


def save_server(path: str, index: int, num_servers: int, stores: dict[int, _Store]) -> None:
    os.makedirs(path, exist_ok=True)
    document = {"format": FORMAT, "num_servers": num_servers, "stores": {
        store_id: {"settings": list(store.settings),
                   "optimizer": None if store.optimizer is None else
                   [store.optimizer.name, store.optimizer.hyperparameters],
                   "shards": {chunk_id: shard.state() for chunk_id, shard in store.shards.items()}}
        for store_id, store in stores.items()}}
    target = server_file(path, index, num_servers)
    torch.save(document, target + ".tmp")
    os.replace(target + ".tmp", target)  # a crash mid-save leaves the previous checkpoint


def load_server(path: str, index: int, num_servers: int, stores: dict[int, _Store]) -> dict:
    """Restore every chunk of ``stores`` from ``path``; returns {"steps": {store: updates}}."""
    target = server_file(path, index, num_servers)
    if not os.path.exists(target):
        found = sorted(f for f in os.listdir(path) if f.startswith("server-")) if os.path.isdir(path) else []
        raise ParameterServerError(f"no checkpoint for server {index} of {num_servers} in {path!r}"
                                   + (f" (found {found}: saved with another number of servers?)"
                                      if found else ""))
    document = torch.load(target, weights_only=False)
    if document.get("format") != FORMAT:
        raise ParameterServerError(f"{target} is not a psrt parameter-server checkpoint")
    _check_layout(document, stores, target)
    steps = {}
    for store_id, store in stores.items():
        saved = document["stores"][store_id]
        for chunk_id, shard in store.shards.items():
            shard.restore(saved["shards"][chunk_id])
        steps[store_id] = min((min(s.applied) for s in store.shards.values()), default=0)
    return {"steps": steps}


def _check_layout(document: dict, stores: dict[int, _Store], target: str) -> None:
    for store_id, store in stores.items():
        saved = document["stores"].get(store_id)
        if saved is None:
            raise ParameterServerError(f"{target} has no KVStore {store_id}")
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
