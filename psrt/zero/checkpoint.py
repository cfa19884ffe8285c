"""Sharded ZeRO checkpoints: every rank saves its shard, any number of ranks can load them, and
:func:`consolidate` turns them into an ordinary ``state_dict`` in one process.

A checkpoint directory holds ``shard_RRRRR.pt`` per rank of the data-parallel set (its
master shards, their optimizer state, the optimizer's hyperparameters) and ``zero_meta.json``,
written by rank 0 only after every rank has written its shard, naming the layout (stage,
parameters, flat groups, shard sizes) and a save id that every shard file carries: a directory
without it, or with a shard from another save, is refused.  ``extras.pt`` (rank 0) keeps the
model's buffers and frozen parameters, which are not sharded.

Loading undoes the sharding of the checkpoint's layout and applies the current one, so a
checkpoint written by N ranks loads on M.  Each rank reads every shard file to do so.
"""
from __future__ import annotations

import json
import os
import uuid

import torch

import psrt.torch as hvd
from psrt import runtime
from psrt.errors import InvalidArgumentError
from psrt.zero.partition import ParamInfo, Partition

FORMAT = "psrt-zero/1"
META = "zero_meta.json"
EXTRAS = "extras.pt"


def shard_file(directory: str, set_rank: int) -> str:
    return os.path.join(directory, f"shard_{set_rank:05d}.pt")


def _atomic_save(obj: object, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def save(zero, directory: str, extra: dict | None = None) -> None:
    """Write ``zero``'s shards to ``directory``; collective over its process set.

    ``extra`` (anything JSON can hold, e.g. the step count) is stored in the metadata and
    returned by :func:`load`.  Raises on every rank if any rank failed to write.
    """
    json.dumps(extra)  # fail before any file is written, on the calling rank
    zero.synchronize()
    save_id = hvd.broadcast_object(uuid.uuid4().hex, root_rank=_first_rank(zero), name="zero.save.id",
                                   process_set=zero.process_set)
    set_rank = zero.process_set.rank()
    error = None
    try:
        os.makedirs(directory, exist_ok=True)
        _atomic_save(_shard_payload(zero, save_id, set_rank), shard_file(directory, set_rank))
        if set_rank == 0:
            _atomic_save(_extras(zero), os.path.join(directory, EXTRAS))
    except OSError as exc:
        error = f"rank {set_rank}: {exc}"
    errors = [e for e in hvd.allgather_object(error, name="zero.save.done", process_set=zero.process_set) if e]
    if errors:
        raise RuntimeError(f"ZeRO checkpoint {directory!r} not saved: {'; '.join(errors)}")
    if set_rank == 0:
        with open(os.path.join(directory, META) + ".tmp", "w") as out:
            json.dump(_meta(zero, save_id, extra), out)
        os.replace(os.path.join(directory, META) + ".tmp", os.path.join(directory, META))
    hvd.barrier(process_set=zero.process_set)


def load(zero, directory: str) -> dict | None:
    """Restore ``zero`` (and its model) from a checkpoint written by any number of ranks with the
    same model and stage; returns the ``extra`` saved with it.  Collective-free: every rank
    reads the files itself."""
    meta = read_meta(directory)
    _check_compatible(zero, meta, directory)
    full = consolidate(directory)
    _restore(zero, full)
    return meta["extra"]


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        raise InvalidArgumentError(f"{directory!r} is not a complete psrt ZeRO checkpoint: {META} is missing "
                                   "(the directory is wrong, or the save did not finish)")
    with open(path) as meta_file:
        meta = json.load(meta_file)
    if meta.get("format") != FORMAT:
        raise InvalidArgumentError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def consolidate(directory: str) -> dict:
    """The checkpoint as one process would hold it: ``{"model": state_dict, "optimizer":
    torch optimizer state_dict, "extra": ..., "per_element_keys": optimizer state keys that hold
    one value per parameter element}``, for a model and a plain optimizer built over its
    trainable parameters in registration order (``optimizer_class(model.parameters())`` when all
    are trainable).  Master weights are returned in the parameters' own dtype."""
    meta = read_meta(directory)
    partition = _partition(meta)
    shards = [_read_shard(directory, r, meta["save_id"]) for r in range(meta["num_shards"])]
    model = torch.load(os.path.join(directory, EXTRAS), map_location="cpu", weights_only=True)
    per_param_state: dict[int, dict] = {}
    per_element: set[str] = set()
    for g, flat in enumerate(partition.groups):
        values = torch.cat([shard["masters"][g] for shard in shards])
        states = [shard["optimizer_state"][g] for shard in shards]
        for param, offset in zip(flat.params, flat.offsets):
            info = partition.params[param]
            model[info.name] = values[offset:offset + info.numel].view(info.shape).to(getattr(torch, info.dtype))
            per_param_state[param] = {}
            for key, value in states[0].items():
                if _is_sharded(value, flat.shard_numel):
                    per_element.add(key)
                    whole = torch.cat([state[key] for state in states])
                    per_param_state[param][key] = whole[offset:offset + info.numel].view(info.shape).clone()
                else:
                    per_param_state[param][key] = value.clone() if isinstance(value, torch.Tensor) else value
    param_groups = [dict(shards[0]["param_groups"][0], params=list(range(len(partition.params))))]
    return {"model": model, "optimizer": {"state": per_param_state, "param_groups": param_groups},
            "extra": meta["extra"], "stage": meta["stage"], "world_size": meta["num_shards"],
            "per_element_keys": sorted(per_element)}


def _is_sharded(value: object, shard_numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == shard_numel


def _first_rank(zero) -> int:
    """The global rank of the process set's first member (roots are global ranks in psrt)."""
    return runtime.current().topology.ranks_of(zero.process_set)[0]


def _shard_payload(zero, save_id: str, set_rank: int) -> dict:
    state = [{key: value.clone() if isinstance(value, torch.Tensor) else value
              for key, value in zero.optimizer.state.get(group.master, {}).items()} for group in zero.groups]
    hyper = [{key: value for key, value in group.items() if key != "params"} for group in zero.param_groups]
    return {"save_id": save_id, "rank": set_rank, "masters": [group.master.detach().clone() for group in zero.groups],
            "optimizer_state": state, "param_groups": hyper, "loss_scaler": zero.loss_scaler.state_dict()}


def _extras(zero) -> dict:
    managed = set(zero.param_names)
    return {name: tensor.detach().clone() for name, tensor in zero.model.state_dict().items() if name not in managed}


def _meta(zero, save_id: str, extra: dict | None) -> dict:
    partition = zero.partition
    return {"format": FORMAT, "save_id": save_id, "stage": zero.stage, "num_shards": partition.num_shards,
            "optimizer_class": _class_name(type(zero.optimizer)),
            "params": [[info.name, list(info.shape), info.dtype] for info in partition.params],
            "groups": [list(flat.params) for flat in partition.groups], "extra": extra}


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _partition(meta: dict) -> Partition:
    infos = [ParamInfo(name, tuple(shape), dtype) for name, shape, dtype in meta["params"]]
    return Partition.build(infos, meta["groups"], meta["num_shards"])


def _read_shard(directory: str, set_rank: int, save_id: str) -> dict:
    path = shard_file(directory, set_rank)
    if not os.path.exists(path):
        raise InvalidArgumentError(f"ZeRO checkpoint {directory!r} lacks {os.path.basename(path)}")
    shard = torch.load(path, map_location="cpu", weights_only=False)
    if shard["save_id"] != save_id:
        raise InvalidArgumentError(f"{path} belongs to another save than {META} (save id {shard['save_id']} "
                                   f"!= {save_id}); the directory mixes two checkpoints")
    return shard


def _check_compatible(zero, meta: dict, directory: str) -> None:
    if meta["stage"] != zero.stage:
        raise InvalidArgumentError(
            f"ZeRO checkpoint {directory!r} was written by stage {meta['stage']}, this optimizer is stage "
            f"{zero.stage}; consolidate it (psrt zero-to-full) and load the state_dict instead")
    if meta["optimizer_class"] != _class_name(type(zero.optimizer)):
        raise InvalidArgumentError(f"ZeRO checkpoint {directory!r} holds {meta['optimizer_class']} state, this "
                                   f"optimizer is {_class_name(type(zero.optimizer))}")
    saved = [ParamInfo(name, tuple(shape), dtype) for name, shape, dtype in meta["params"]]
    mine = list(zero.partition.params)
    for index in range(max(len(saved), len(mine))):
        theirs = saved[index] if index < len(saved) else None
        ours = mine[index] if index < len(mine) else None
        if theirs != ours:
            raise InvalidArgumentError(
                f"ZeRO checkpoint {directory!r} is of a different model: trainable parameter {index} is "
                f"{_describe(theirs)} in the checkpoint and {_describe(ours)} here")


def _describe(info: ParamInfo | None) -> str:
    return "absent" if info is None else f"{info.name!r} {list(info.shape)} {info.dtype}"


def _restore(zero, full: dict) -> None:
    """Write the consolidated values into this rank's layout: masters, optimizer state,
    hyperparameters, compute parameters, and the model's unsharded entries."""
    partition = zero.partition
    shard = zero.process_set.rank() if partition.num_shards > 1 else 0
    state, per_element = full["optimizer"]["state"], set(full["per_element_keys"])
    with torch.no_grad():
        for g, group in enumerate(zero.groups):
            flat = partition.groups[g]
            group.master.zero_()
            first = state[flat.params[0]]
            restored = {key: torch.zeros(flat.shard_numel, dtype=value.dtype, device=group.master.device)
                        if key in per_element
                        else (value.clone() if isinstance(value, torch.Tensor) else value)
                        for key, value in first.items()}
            for piece in partition.pieces(g, shard):
                where = slice(piece.shard_offset, piece.shard_offset + piece.stop - piece.start)
                values = full["model"][partition.params[piece.param].name].reshape(-1)
                group.master[where] = values[piece.start:piece.stop]
                for key in per_element & restored.keys():
                    restored[key][where] = state[piece.param][key].reshape(-1)[piece.start:piece.stop]
            if restored:
                zero.optimizer.state[group.master] = restored
            group.publish_local()
            for param, index in zip(group.params, flat.params):
                if not group.gathered_on_demand:
                    param.copy_(full["model"][partition.params[index].name])
    for key, value in full["optimizer"]["param_groups"][0].items():
        if key != "params":
            zero.optimizer.param_groups[0][key] = value
    managed = set(zero.param_names)
    zero.model.load_state_dict({k: v for k, v in full["model"].items() if k not in managed}, strict=False)
