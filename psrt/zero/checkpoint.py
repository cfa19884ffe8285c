"""Sharded ZeRO checkpoints: every rank saves its shard, any number of ranks can load them, and
:func:`consolidate` turns them into an ordinary ``state_dict`` in one process.

A checkpoint directory holds ``shard_RRRRR.pt`` per shard (its master values, their optimizer
state, the optimizer's hyperparameters and the loss scale), ``extras.pt`` (the model's buffers
and frozen parameters, which are not sharded) and ``zero_meta.json``, written by rank 0 only
after every rank has written its files, naming the layout (stage, parameters, flat groups,
shard count), every file's size and sha256, and a save id that every other file carries: a
directory without it, or with a file from another save, is refused.  The ``.pt`` files are
safetensors files (:mod:`psrt.checkpoint.files`: nothing pickled, so none can run code; those
of earlier psrt, ``torch.save`` archives, are read with ``weights_only``).  Each file is
checked against its record before it is read, and a damaged one is refused naming the file
and what is wrong.  Stage 0 holds one shard
(every rank has everything), so rank 0 alone writes it.

Loading undoes the sharding of the checkpoint's layout and applies the current one, so a
checkpoint written by N ranks loads on M: each rank opens only the shard files that overlap
its own shard (every shard file holds the step counts and hyperparameters), checks each
against its record, and reads from them only the runs of elements it keeps, into its new
shard (:mod:`psrt.zero.resharding`), so it holds its own shard beyond what it had, never the
whole model.  Stages 1 and 2 then gather the parameters from the restored shards, as after a
step.  Only :func:`consolidate` (``psrt zero-to-full``, one process) reads every shard.
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid
import zipfile
from dataclasses import dataclass

import torch

from psrt.background_save import SaveHandle, saver_of, wait_for
from psrt.checkpoint import files as checkpoint_files
from psrt.errors import CheckpointError, InvalidArgumentError
from psrt.zero.flat import publish_all
from psrt.zero.partition import ParamInfo, Partition, reshard_reads
from psrt.zero.resharding import own_shards, per_element_keys, whole

FORMAT = "psrt-zero/3"  # safetensors files
# Written by earlier psrt, whose files are torch.save archives (still read, with weights_only):
TORCH_FILES_FORMAT = "psrt-zero/2"
# Written before the metadata recorded each file's size and sha256: still loaded (with
# weights_only, as every file), without the check against the metadata.
UNCHECKED_FORMAT = "psrt-zero/1"
META = "zero_meta.json"
EXTRAS = "extras.pt"
_META_KEYS = ("save_id", "stage", "num_shards", "optimizer_class", "params", "groups", "extra")


def shard_file(directory: str, shard: int) -> str:
    return os.path.join(directory, f"shard_{shard:05d}.pt")


def _raise_if_any_failed(failure: Exception | None, what: str, zero, written: dict | None = None) -> dict:
    """Share each rank's outcome so that all raise together: a rank that failed raises its own
    exception, the others an error naming every rank that failed.  Returns what every rank
    passed as ``written`` (file name -> record), for the metadata."""
    mine = None if failure is None else f"rank {zero.channel.rank}: {type(failure).__name__}: {failure}"
    outcomes = zero.channel.allgather_object((mine, written or {}), name=f"zero.{what}.outcome")
    errors = [error for error, _ in outcomes if error]
    if failure is not None:
        raise failure
    if errors:
        raise CheckpointError(f"ZeRO checkpoint {what} failed on other ranks: {'; '.join(errors)}")
    return {name: record for _, files in outcomes for name, record in files.items()}


def _save_file(document: dict, path: str) -> dict[str, dict]:
    return {os.path.basename(path): checkpoint_files.save_tensors(document, path).to_json()}


def save(zero, directory: str, extra: dict | None = None, *, background: bool = False) -> SaveHandle | None:
    """Write ``zero``'s shards to ``directory``.

    If any rank fails to write, every rank raises: that rank its own error, the others one
    naming it.

    With ``background=True`` (torch DCP's ``async_save``) the shards are written by a thread
    (:mod:`psrt.background_save`): this returns once they are copied, with a handle whose
    ``wait()`` blocks until ``zero_meta.json`` is written, and raises (on every rank) a
    :class:`~psrt.errors.CheckpointError` naming each rank that failed.  The set's next save,
    or ``shutdown()``, waits for it first.  Until ``zero_meta.json`` is written the directory
    is incomplete: save to a new directory each time to keep the previous checkpoint whole
    across a crash.

    Collective: every rank of ``zero``'s process set calls it, in the same order, with the
    same ``background``.

    :param zero: the :class:`ZeroOptimizer` to save.
    :param directory: where the shards go, the same on every rank (a shared file system when
        the ranks are on several hosts).
    :param extra: anything JSON can hold (e.g. the step count), stored in the metadata and
        returned by :func:`load`; default None.
    :param background: write in the background; default False.
    :returns: the background save's handle, or None.
    """
    json.dumps(extra)  # fail before any file is written, on the calling rank
    wait_for(zero.runtime, zero.process_set)  # the save in flight first: its error, and the copies it holds
    saver = saver_of(zero.runtime, zero.process_set) if background else None
    zero.synchronize()
    save_id = zero.channel.broadcast_object(uuid.uuid4().hex, zero.channel.ranks[0], name="zero.save.id")
    set_rank = zero.channel.rank
    documents, unprepared = {}, None  # path -> what goes there (clones: nothing writes them afterwards)
    try:
        if set_rank < zero.partition.num_shards:
            documents[shard_file(directory, set_rank)] = _shard_payload(zero, save_id)
        if set_rank == 0:
            documents[os.path.join(directory, EXTRAS)] = {"save_id": save_id, "entries": _extras(zero)}
    except Exception as exc:  # raised by write() below, so that every rank learns of it
        unprepared = exc
    meta = _meta(zero, save_id, extra, {})

    def write(documents: dict) -> dict[str, dict]:
        if unprepared is not None:
            raise unprepared
        os.makedirs(directory, exist_ok=True)
        written = {}
        for path, document in documents.items():
            written.update(_save_file(document, path))
        return written

    def publish(files: dict[str, dict]) -> None:
        checkpoint_files.write_json(dict(meta, files=files), os.path.join(directory, META))

    if saver is not None:
        staged = saver.stage(documents)
        return saver.submit(lambda: write(staged.take()), publish, lambda errors: CheckpointError(
            f"ZeRO checkpoint save to {directory!r} failed, its {META} was not written: {'; '.join(errors)}"))
    failure, written = None, {}
    try:
        written = write(documents)
    except Exception as exc:  # reported on every rank below, never left on one
        failure = exc
    files = _raise_if_any_failed(failure, "save", zero, written)
    if set_rank == 0:
        try:
            publish(files)
        except Exception as exc:
            failure = exc
    _raise_if_any_failed(failure, "save", zero)
    return None


def load(zero, directory: str) -> dict | None:
    """Restore ``zero`` (and its model) from a checkpoint written by any number of ranks with the
    same model, stage and optimizer class; returns the ``extra`` saved with it.  Each rank reads
    only the parts of the files it keeps.  If any rank cannot read or accept the checkpoint,
    every rank raises before anything changes (as :func:`save` does).

    Collective: every rank of ``zero``'s process set calls it, in the same order.

    :param zero: the :class:`ZeroOptimizer` to restore.
    :param directory: the checkpoint's directory, the same on every rank.
    :returns: the ``extra`` saved with it.
    """
    restored, failure = None, None
    try:
        with contextlib.ExitStack() as files:
            restored = _read_own_shard(zero, directory, files)
    except Exception as exc:
        failure = exc
    _raise_if_any_failed(failure, "load", zero)
    _install(zero, restored)
    return restored.extra


@dataclass
class _Restored:
    """What a rank takes from a checkpoint, all of it read before anything changes."""

    masters: list[torch.Tensor]  # this rank's shard of each flat group
    states: list[dict]           # and its optimizer state
    param_groups: list[dict]     # the optimizer's hyperparameters
    loss_scaler: dict
    entries: dict[str, torch.Tensor]  # the model's unsharded entries
    extra: object


def _read_own_shard(zero, directory: str, files: contextlib.ExitStack) -> _Restored:
    """This rank's part of the checkpoint in ``directory``, from the files that hold it, each
    checked against its record before any is read."""
    meta = read_meta(directory)
    _check_compatible(zero, meta, directory)
    saved = _partition(meta)
    needed = {read.shard for read in reshard_reads(saved, zero.partition, zero.shard_index)} or {0}
    shards = {shard: (shard_file(directory, shard), _open(shard_file(directory, shard), meta, files))
              for shard in sorted(needed)}
    entries = _open(os.path.join(directory, EXTRAS), meta, files)["entries"]
    masters, states = own_shards(saved, zero.partition, zero.shard_index, shards,
                                 [group.master for group in zero.groups])
    first = shards[min(shards)][1]  # every shard holds the same hyperparameters and loss scale
    return _Restored(masters, states, whole(first["param_groups"]), whole(first["loss_scaler"]), whole(entries),
                     meta["extra"])


def read_meta(directory: str) -> dict:
    """The commit record of the checkpoint in ``directory``; raises naming the file and what is wrong."""
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        raise InvalidArgumentError(f"{directory!r} is not a complete psrt ZeRO checkpoint: {META} is missing "
                                   "(the directory is wrong, or the save did not finish)")
    meta = checkpoint_files.read_json(path, InvalidArgumentError)
    if meta.get("format") not in (FORMAT, TORCH_FILES_FORMAT, UNCHECKED_FORMAT):
        raise InvalidArgumentError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    missing = [key for key in _META_KEYS + (("files",) if meta["format"] != UNCHECKED_FORMAT else ()) if key not in meta]
    if missing:
        raise InvalidArgumentError(f"{path} is damaged: it lacks {missing}; restore it from a backup or save again")
    return meta


def consolidate(directory: str) -> dict:
    """The checkpoint as one process would hold it: ``{"model": state_dict, "optimizer": torch
    optimizer state_dict, "extra": ..., "loss_scaler": ..., "per_element_keys": optimizer state
    keys holding one value per parameter element}``, for the model and a plain optimizer built
    with the same parameter groups (``optimizer_class(model.parameters())`` when none were
    given and all parameters are trainable).  Master weights come back in the parameters'
    own dtype."""
    meta = read_meta(directory)
    partition = _partition(meta)
    shards = [_read(shard_file(directory, shard), meta) for shard in range(meta["num_shards"])]
    model = _read(os.path.join(directory, EXTRAS), meta)["entries"]
    optimizer_groups = _optimizer_groups(meta)
    position = _positions(optimizer_groups)
    per_param_state: dict[int, dict] = {}
    per_element: set[str] = set()
    for g, flat in enumerate(partition.groups):
        values = torch.cat([shard["masters"][g] for shard in shards])
        states = [shard["optimizer_state"][g] for shard in shards]
        keys = per_element_keys(states[0], flat.shard_numel)
        per_element.update(keys)
        joined = {key: torch.cat([state[key] for state in states]) for key in keys}
        for param, offset in zip(flat.params, flat.offsets):
            info = partition.params[param]
            where = slice(offset, offset + info.numel)
            model[info.name] = values[where].view(info.shape).to(getattr(torch, info.dtype))
            per_param_state[position[param]] = {
                key: joined[key][where].view(info.shape).clone() if key in joined
                else (value.clone() if isinstance(value, torch.Tensor) else value)
                for key, value in states[0].items()}
    for alias, name in meta.get("aliases", {}).items():  # a tied parameter under its other names
        model[alias] = model[name]
    param_groups = [dict(options, params=[position[param] for param in members])
                    for options, members in zip(shards[0]["param_groups"], optimizer_groups)]
    return {"model": model, "optimizer": {"state": per_param_state, "param_groups": param_groups},
            "extra": meta["extra"], "stage": meta["stage"], "world_size": meta["num_shards"],
            "loss_scaler": shards[0]["loss_scaler"], "per_element_keys": sorted(per_element)}


def _shard_payload(zero, save_id: str) -> dict:
    state = [{key: value.clone() if isinstance(value, torch.Tensor) else value
              for key, value in zero.optimizer.state.get(group.master, {}).items()} for group in zero.groups]
    hyper = [{key: value for key, value in group.items() if key != "params"} for group in zero.param_groups]
    return {"save_id": save_id, "masters": [group.master.detach().clone() for group in zero.groups],
            "optimizer_state": state, "param_groups": hyper, "loss_scaler": zero.loss_scaler.state_dict()}


def _extras(zero) -> dict:
    return {name: tensor.detach().clone() for name, tensor in zero.unsharded_state_dict().items()}


def _meta(zero, save_id: str, extra: dict | None, files: dict[str, dict]) -> dict:
    partition = zero.partition
    return {"format": FORMAT, "save_id": save_id, "stage": zero.stage, "num_shards": partition.num_shards,
            "optimizer_class": _class_name(type(zero.optimizer)),
            "params": [[info.name, list(info.shape), info.dtype] for info in partition.params],
            "groups": [list(flat.params) for flat in partition.groups], "optimizer_groups": zero.optimizer_groups,
            "aliases": zero.aliases, "extra": extra, "files": files}


def _optimizer_groups(meta: dict) -> list[list[int]]:
    """The optimizer's parameter groups (parameter indices, in the order given); checkpoints
    from before parameter groups hold one group of every parameter in registration order."""
    return meta.get("optimizer_groups") or [list(range(len(meta["params"])))]


def _positions(optimizer_groups: list[list[int]]) -> dict[int, int]:
    """Each parameter's index in torch's optimizer state_dict, which numbers the parameters
    group after group in the order given."""
    return {param: i for i, param in enumerate(p for members in optimizer_groups for p in members)}


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _partition(meta: dict) -> Partition:
    infos = [ParamInfo(name, tuple(shape), dtype) for name, shape, dtype in meta["params"]]
    return Partition.build(infos, meta["groups"], meta["num_shards"])


def _read(path: str, meta: dict) -> dict:
    """A file of the checkpoint ``meta`` describes, read whole after checking it against its
    record there (a missing one is refused by name, as every other fault)."""
    return _checked(checkpoint_files.load_tensors(path, _record(path, meta), InvalidArgumentError), path, meta)


def _open(path: str, meta: dict, files: contextlib.ExitStack) -> dict:
    """A file of the checkpoint ``meta`` describes, checked as :func:`_read` does, its tensors
    left in the file (kept open by ``files``) to be read in parts; a file of earlier psrt (a
    ``torch.save`` archive) is read whole."""
    record = _record(path, meta)
    if zipfile.is_zipfile(path):
        return _checked(checkpoint_files.load_tensors(path, record, InvalidArgumentError), path, meta)
    stored = files.enter_context(checkpoint_files.open_tensors(path, record, InvalidArgumentError))
    return _checked(stored.document, path, meta)


def _record(path: str, meta: dict) -> checkpoint_files.FileRecord | None:
    if meta["format"] == UNCHECKED_FORMAT:
        return None
    return checkpoint_files.record_of(meta["files"], path, os.path.join(os.path.dirname(path), META),
                                      InvalidArgumentError)


def _checked(payload: object, path: str, meta: dict) -> dict:
    """``payload``, the document of ``path``, after checking that it is of the save ``meta`` records."""
    if not isinstance(payload, dict):
        raise InvalidArgumentError(f"{path} is not a psrt ZeRO checkpoint file (it holds a "
                                   f"{type(payload).__name__}); restore it from a backup or save again")
    if payload.get("save_id") != meta["save_id"]:
        raise InvalidArgumentError(f"{path} belongs to another save than {META} (save id {payload.get('save_id')} "
                                   f"!= {meta['save_id']}); the directory mixes two checkpoints")
    return payload


def _check_compatible(zero, meta: dict, directory: str) -> None:
    if meta["stage"] != zero.stage:
        raise InvalidArgumentError(
            f"ZeRO checkpoint {directory!r} was written by stage {meta['stage']}, this optimizer is stage "
            f"{zero.stage}: load it with stage {meta['stage']}, or consolidate it (psrt zero-to-full) and load "
            "the model state_dict into the model before wrapping it (the optimizer state then starts afresh)")
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
    if _optimizer_groups(meta) != zero.optimizer_groups:
        raise InvalidArgumentError(
            f"ZeRO checkpoint {directory!r} has parameter groups {_optimizer_groups(meta)} (parameter indices), this "
            f"optimizer {zero.optimizer_groups}: wrap the model with the param_groups it was saved with")


def _describe(info: ParamInfo | None) -> str:
    return "absent" if info is None else f"{info.name!r} {list(info.shape)} {info.dtype}"


def _install(zero, restored: _Restored) -> None:
    """Put what :func:`_read_own_shard` read in place: masters, optimizer state, compute
    parameters (gathered over the set in stages 1 and 2), hyperparameters, loss scale, and the
    model's unsharded entries."""
    with torch.no_grad():
        for group, master, state in zip(zero.groups, restored.masters, restored.states):
            group.master.copy_(master)
            if state:
                zero.optimizer.state[group.master] = state
            else:
                zero.optimizer.state.pop(group.master, None)
    publish_all(zero.groups, zero.channel, restored.masters)
    restored.masters.clear()
    for saved, group in zip(restored.param_groups, zero.optimizer.param_groups):
        group.update((key, value) for key, value in saved.items() if key != "params")
    zero.loss_scaler.load_state_dict(restored.loss_scaler)
    managed = set(zero.param_names) | set(zero.aliases)
    zero.model.load_state_dict({k: v for k, v in restored.entries.items() if k not in managed}, strict=False)
