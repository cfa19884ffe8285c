"""A model's own checkpoint format, read and written by the shards of a split model.

A Hugging Face checkpoint directory (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) maps the model's parameter names to full tensors.
:func:`load_pretrained` fills each rank's part of a model from it, reading only the slices
the rank holds (safetensors reads a slice without the rest of the tensor), so no rank ever
holds the whole model; a model built on the meta device is materialised as it loads.
:func:`save_pretrained` writes such a directory from the shards: each pipeline stage's
tensors, joined over the TP set, go to one file (under ZeRO-3, each data-parallel rank writes
the parameters it owns, assembled from the others' shards, so no rank holds the model), with
the index and the config beside them, so ``from_pretrained`` in one process, or
:func:`load_pretrained` at any other layout, takes it.  Names are the model's own
(:func:`psrt.tp.parallelize` and :func:`psrt.pp.split` keep them).
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from psrt import runtime, tp
from psrt.checkpoint import files as checkpoint_files
from psrt.checkpoint.safetensors_reader import SafetensorsReader
from psrt.errors import InvalidArgumentError
from psrt.grid import ProcessGrid
from psrt.tp.sharding import Sharding, sharding_of
from psrt.zero.whole import owned_parameters

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
RECORDS = "psrt_files"  # in the index's metadata: each weight file's size and sha256, as psrt wrote it
__all__ = ["LoadReport", "load_pretrained", "save_pretrained"]


@dataclass(frozen=True)
class LoadReport:
    """What one rank's :func:`load_pretrained` read: bytes of its own slices, bytes of the whole
    checkpoint, the largest single tensor in it, and the seconds it took."""

    bytes_read: int
    checkpoint_bytes: int
    largest_tensor_bytes: int
    seconds: float


def _weight_files(directory: str) -> tuple[dict[str, str], dict]:
    """Each tensor name of the checkpoint in ``directory`` and the file holding it, and the
    size and sha256 psrt recorded for each file in the index (none for a checkpoint written
    by anything else)."""
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        document = checkpoint_files.read_json(index, InvalidArgumentError)
        weight_map, metadata = document.get("weight_map"), document.get("metadata")
        if not isinstance(weight_map, dict):
            raise InvalidArgumentError(f"{index} has no weight_map naming each tensor's file: it is damaged")
        records = metadata.get(RECORDS, {}) if isinstance(metadata, dict) else {}
        return {name: os.path.join(directory, file) for name, file in weight_map.items()}, records
    single = os.path.join(directory, WEIGHTS)
    if not os.path.exists(single):
        raise InvalidArgumentError(f"{directory} holds neither {WEIGHTS} nor {INDEX}: not a safetensors checkpoint "
                                   "directory (save it with save_pretrained(..., safe_serialization=True))")
    with SafetensorsReader(single) as reader:
        return {name: single for name in reader.names()}, {}


def _by_model_name(files: dict[str, str], names: list[str]) -> dict[str, tuple[str, str]]:
    """Each tensor of the checkpoint under the model's name for it: its file and its name
    there.  The names are the same, or the checkpoint's lack the model's first component (a
    base model's checkpoint, loaded into the model with a head around it)."""
    prefix = None
    if not any(name in files for name in names):
        prefix = next((name.split(".", 1)[0] for name in names if name.split(".", 1)[-1] in files and "." in name),
                      None)
    lead = f"{prefix}." if prefix else ""
    return {lead + name: (path, name) for name, path in files.items()}


def load_pretrained(module: nn.Module, directory: str, *, device: torch.device | str | None = None) -> LoadReport:
    """Fill this rank's part of a model (a model after ``tp.parallelize``, a stage from
    ``pp.split``, or a plain model) from the checkpoint in ``directory``, reading only the
    slices this rank holds.  Tensors on the meta device are created on ``device`` (default:
    the CPU) as they load; the others are overwritten in place.  Every entry of this rank's
    ``state_dict`` must be in the checkpoint (a tied duplicate may be left out, as
    ``save_pretrained`` does); a checkpoint of the base model (``h.0.attn...`` for
    ``transformer.h.0.attn...``, as GPT-2's are published) is matched by dropping the
    model's prefix.  No communication, and no grid to give: each rank's shardings already say
    which slices it holds.
    """
    start = time.perf_counter()
    entries = module.state_dict(keep_vars=True)
    copies = {name: tie.tensor for tie in getattr(module, "ties", ()) for name in tie.names}
    aliases = getattr(module, "tied_aliases", {})
    wanted = {**entries, **copies}
    weight_files, records = _weight_files(directory)
    files = _by_model_name(weight_files, list(wanted))
    first_name = {}
    for name, tensor in wanted.items():
        first_name.setdefault(id(tensor), name)
    with contextlib.ExitStack() as stack:
        readers: dict[str, SafetensorsReader] = {}

        def reader(path: str) -> SafetensorsReader:
            if path not in readers:  # every file this rank reads is checked here, before any tensor changes
                _check_against_record(path, records, directory)
                readers[path] = stack.enter_context(SafetensorsReader(path))
            return readers[path]
        plans, missing, seen = [], [], set()
        for name, target in wanted.items():
            if id(target) in seen:
                continue
            seen.add(id(target))
            source = next((n for n in (name, aliases.get(name), first_name[id(target)]) if n in files), None)
            if source is None:
                missing.append(name)
                continue
            path, stored = files[source]
            plans.append((target, reader(path), stored, _block(reader(path), stored, sharding_of(target), target)))
        if missing:
            raise InvalidArgumentError(f"the checkpoint in {directory} lacks {len(missing)} of this rank's entries: "
                                       f"{missing[:5]}")
        total, largest = _sizes({stored: path for path, stored in files.values()}, reader)
        loaded: dict[int, torch.Tensor] = {}
        read = 0
        for target, file, stored, block in plans:  # every header and shape agreed: now tensors change
            value = _read(file, stored, block)
            read += value.numel() * value.element_size()
            loaded[id(target)] = _place(target, value, device)
    _materialise(module, loaded, device)
    return LoadReport(read, total, largest, time.perf_counter() - start)


def _check_against_record(path: str, records: dict, directory: str) -> None:
    """A file of a checkpoint psrt saved is compared with the size and sha256 its index records."""
    if records:
        record = checkpoint_files.record_of(records, path, os.path.join(directory, INDEX), InvalidArgumentError)
        checkpoint_files.check_file(path, record, InvalidArgumentError)


@dataclass(frozen=True)
class _Block:
    """Where this rank's block of a tensor lies along ``dim``: ``(begin, end, length)`` per
    stride part (rows past ``end - begin`` are padding), and the block's shape."""

    dim: int
    parts: list[tuple[int, int, int]]
    shape: tuple[int, ...]


def _block(reader: SafetensorsReader, name: str, sharding: Sharding | None, target: torch.Tensor) -> _Block:
    """This rank's block of ``name``, after checking that the checkpoint's shape fits it."""
    full, shape = reader.shape(name), tuple(target.shape)
    if not full:  # a scalar
        return _Block(0, [], ())
    whole = sharding is None or sharding.parts == 1
    parts = [(0, full[0], full[0])] if whole else sharding.source_ranges()
    dim = 0 if whole else sharding.dim
    if not whole and full[dim] != sharding.full_size:
        raise InvalidArgumentError(f"{name}: the checkpoint's shape {full} does not fit the model "
                                   f"({sharding.full_size} along dim {dim})")
    block = (*full[:dim], sum(length for _, _, length in parts), *full[dim + 1:])
    if block != shape:
        raise InvalidArgumentError(f"{name}: this rank holds shape {shape}, the checkpoint gives {block}")
    return _Block(dim, parts, block)


def _read(reader: SafetensorsReader, name: str, block: _Block) -> torch.Tensor:
    """This rank's block of ``name``: one read when it is one run of rows without padding."""
    if not block.parts:
        return reader.read(name)
    if len(block.parts) == 1 and block.parts[0][1] - block.parts[0][0] == block.parts[0][2]:
        return reader.read(name, block.dim, block.parts[0][0], block.parts[0][1])
    value = torch.zeros(block.shape, dtype=reader.dtype(name))
    position = 0
    for begin, end, length in block.parts:  # rows past the end of an odd vocabulary stay zero
        value.narrow(block.dim, position, end - begin).copy_(reader.read(name, block.dim, begin, end))
        position += length
    return value


def _place(target: torch.Tensor, value: torch.Tensor, device) -> torch.Tensor:
    """The loaded tensor: ``target`` itself, overwritten, or a new one where it was on meta."""
    if not target.is_meta:
        with torch.no_grad():
            target.copy_(value)
        return target
    value = value.to(device=device or "cpu", dtype=target.dtype)
    if isinstance(target, nn.Parameter):
        value = nn.Parameter(value, requires_grad=target.requires_grad)
    else:  # a pipeline's copy of a parameter another stage owns learns like one
        value.requires_grad_(target.requires_grad)
    if sharding_of(target) is not None:
        value.tp_sharding = sharding_of(target)
    return value


def _materialise(module: nn.Module, loaded: dict[int, torch.Tensor], device) -> None:
    """Put every tensor created for a meta one where the meta one was (tied uses included),
    and rebuild the stateless buffers still on meta (rotary tables) from their module's config."""
    for tie in getattr(module, "ties", ()):
        tie.tensor = loaded.get(id(tie.tensor), tie.tensor)
    for name, sub in module.named_modules():
        for table in (sub._parameters, sub._buffers):
            for leaf, tensor in table.items():
                if tensor is not None and id(tensor) in loaded:
                    table[leaf] = loaded[id(tensor)]
        stale = [leaf for leaf, tensor in sub._buffers.items() if tensor is not None and tensor.is_meta]
        if stale:
            _rebuild_buffers(name, sub, stale, device)


def _rebuild_buffers(name: str, sub: nn.Module, stale: list[str], device) -> None:
    config = getattr(sub, "config", None)
    if config is None:
        raise InvalidArgumentError(f"{name}: buffers {stale} are on the meta device and not in the checkpoint; "
                                   "build the model with its buffers on a real device")
    with torch.device(device or "cpu"):
        fresh = type(sub)(config)
    for leaf in stale:
        sub._buffers[leaf] = fresh._buffers[leaf]


def _sizes(files: dict[str, str], reader) -> tuple[int, int]:
    """Bytes of the whole checkpoint and of its largest tensor (from the files' headers)."""
    sizes = [reader(path).nbytes(name) for name, path in files.items()]
    return sum(sizes), max(sizes, default=0)


def _remove_weights(directory: str) -> None:
    """The weight files and index a previous save left in ``directory``."""
    if not os.path.isdir(directory):
        return
    for file in os.listdir(directory):
        if file in (WEIGHTS, INDEX) or re.fullmatch(r"model-\d+-of-\d+\.safetensors", file):
            os.remove(os.path.join(directory, file))


def save_pretrained(module: nn.Module, directory: str, grid: ProcessGrid | None = None, *,
                    config: object = None, optimizer: object = None) -> None:
    """Write a ``save_pretrained``-style directory from the shards: one safetensors file per
    pipeline stage (its tensors joined over the TP set, written by the stage's first data-
    and tensor-parallel rank), the index naming each tensor's file, and ``config`` (a
    ``transformers`` config, written with its own ``save_pretrained``).  A parameter tied to
    another (GPT-2's output head) is written once, under its first name, as ``transformers``
    does.  Weight files a previous save left in ``directory`` are removed first (a save at
    another layout names its files otherwise).  Each file is written and fsynced before the
    index, which records its size and sha256, so a crash leaves no index naming a half-written
    file.  Returns once the directory is complete.

    ``optimizer``: the :class:`~psrt.zero.ZeroOptimizer` wrapping ``module``, if any.  Under
    ZeRO-3 (without TP) no rank holds the model, nor gathers it: every data-parallel rank
    writes a file of its own, ``model-0000R-of-0000N.safetensors``, holding the parameters it
    owns (at most its shard plus the largest parameter, :func:`psrt.zero.partition.writers`),
    each assembled from the other ranks' pieces, from the master weights (the parameters' own
    dtype); the buffers go to the stage's first rank's file.

    Collective: every rank of the world calls it, in the same order.
    """
    channel = (runtime.current() if grid is None else grid.runtime).channel()
    if getattr(optimizer, "stage", None) == 3 and (grid is None or grid.shape.tp == 1):
        tensors, file, writes = _owned_part(module, optimizer, grid, channel)
    else:
        tensors, file, writes = _gathered_part(module, grid, optimizer, channel)
    if channel.rank == 0:
        _remove_weights(directory)  # a directory saved at another layout would keep files readers prefer
    channel.allgather_object(None, name="psrt.save_pretrained.cleared")
    written = {}
    if writes:
        os.makedirs(directory, exist_ok=True)
        record = checkpoint_files.write_safetensors(tensors, os.path.join(directory, file), {"format": "pt"})
        written = {"file": file, "record": record.to_json(),
                   "sizes": {name: t.numel() * t.element_size() for name, t in tensors.items()}}
    parts = [part for part in channel.allgather_object(written, name="psrt.save_pretrained") if part]
    if channel.rank == 0:  # every weight file is on disk: the index, which records them, comes last
        if config is not None:
            config.save_pretrained(directory)
        write_index(directory, parts)
    channel.allgather_object(None, name="psrt.save_pretrained.done")


def _gathered_part(module: nn.Module, grid: ProcessGrid | None, optimizer: object, channel
                   ) -> tuple[dict[str, torch.Tensor], str, bool]:
    """This stage's tensors joined over the TP set, its file's name, and whether this rank
    writes it.  ZeRO-3's parameters (over a grid with TP) are gathered for it."""
    gathered = optimizer.gathered_parameters() if hasattr(optimizer, "gathered_parameters") else \
        contextlib.nullcontext()
    with gathered:
        full = tp.full_state_dict(module, None if grid is None else grid.tp_set)
        seen, tensors = set(), {}
        for name, tensor in module.state_dict(keep_vars=True).items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                tensors[name] = full[name].detach().cpu().contiguous()
    stages = 1 if grid is None else grid.shape.pp
    stage = 0 if grid is None else grid.coords.pp
    writes = channel.rank == 0 if grid is None else (grid.coords.dp, grid.coords.tp, grid.coords.cp) == (0, 0, 0)
    file = WEIGHTS if stages == 1 else f"model-{stage + 1:05d}-of-{stages:05d}.safetensors"
    return tensors, file, writes


def _owned_part(module: nn.Module, zero, grid: ProcessGrid | None, channel
                ) -> tuple[dict[str, torch.Tensor], str, bool]:
    """ZeRO-3: the parameters this rank owns, assembled whole, the buffers too on the stage's
    first data-parallel rank, and this rank's file's name; whether it writes (its CP
    coordinate is 0)."""
    if zero.model is not module:
        raise InvalidArgumentError(f"save_pretrained: the optimizer wraps a {type(zero.model).__name__}, not the "
                                   f"{type(module).__name__} given: pass the module the ZeroOptimizer was built on")
    dp_ranks = channel.ranks if grid is None else grid.runtime.channel(grid.dp_set).ranks
    if zero.channel.ranks != dp_ranks:
        raise InvalidArgumentError(f"save_pretrained: the ZeroOptimizer's process set holds world ranks "
                                   f"{list(zero.channel.ranks)}, the data-parallel ranks are {list(dp_ranks)}: "
                                   "pass the grid the model was built on")
    tensors = owned_parameters(zero)
    if zero.channel.rank == 0:
        tensors.update((name, value.cpu().contiguous()) for name, value in zero.unsharded_state_dict().items())
    stage, stages = (0, 1) if grid is None else (grid.coords.pp, grid.shape.pp)
    index, files = stage * zero.channel.size + zero.channel.rank, stages * zero.channel.size
    writes = grid is None or grid.coords.cp == 0
    return tensors, f"model-{index + 1:05d}-of-{files:05d}.safetensors", writes


def write_index(directory: str, parts: list[dict]) -> None:
    """The index of a directory of weight files: each tensor's file (``weight_map``) and, in
    its metadata, the total size and each file's size and sha256 (``psrt_files``), which
    :func:`load_pretrained` checks.  ``parts``: per file written, ``{"file", "record",
    "sizes": {tensor: bytes}}``.  Written even for one file (``transformers`` then reads the
    file and ignores the index) so that every save has its record."""
    weight_map = {name: part["file"] for part in parts for name in part["sizes"]}
    total = sum(size for part in parts for size in part["sizes"].values())
    checkpoint_files.write_json({"metadata": {"total_size": total, RECORDS: {p["file"]: p["record"] for p in parts}},
                                 "weight_map": dict(sorted(weight_map.items()))}, os.path.join(directory, INDEX))
