"""A rank's shard of every flat group, taken from the shards a ZeRO checkpoint was saved as
(by another number of ranks, with other flat groups): only the runs of elements that
overlap it are read (:func:`psrt.zero.partition.reshard_reads`), straight into the new shard
(on a GPU, or into another dtype, through a block at a time), so a rank holds its own shard,
never the whole state.

The saved shards come as their documents (``{"masters": [...], "optimizer_state": [...]}``)
opened with :func:`psrt.checkpoint.files.open_tensors`, whose tensors stay in the file until
read; those of earlier psrt, read whole, hold ordinary tensors, and are sliced in memory.
"""
from __future__ import annotations

import torch

from psrt.checkpoint.document import map_tensors
from psrt.checkpoint.files import StoredTensor
from psrt.errors import InvalidArgumentError
from psrt.zero.partition import Partition, Read, reshard_reads

#: Elements read from a file at once where they cannot be read into place (1 MiB in float32):
#: beyond its own shard, what a rank then holds while restoring.
READ_ELEMENTS = 1 << 18


def is_tensor(value: object) -> bool:
    """A tensor, read or still in its file."""
    return isinstance(value, (torch.Tensor, StoredTensor))


def whole(value: object) -> object:
    """``value`` with every tensor in it read (one still in its file) or copied (one read
    before, which may be shared)."""
    return map_tensors(value, lambda tensor: tensor.read() if isinstance(tensor, StoredTensor) else tensor.clone(),
                       (torch.Tensor, StoredTensor))


def per_element_keys(state: dict, shard_numel: int) -> list[str]:
    """The keys of a flat group's optimizer state holding one value per element of its shard
    (Adam's moments), as opposed to scalars (its step)."""
    return [key for key, value in state.items() if is_tensor(value) and tuple(value.shape) == (shard_numel,)]


def own_shards(saved: Partition, current: Partition, shard: int, files: dict[int, tuple[str, dict]],
               masters: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[dict]]:
    """Shard ``shard`` of every flat group of ``current``: its master values and optimizer
    state, new tensors shaped, typed and placed as ``masters`` (this rank's), padding zero.
    The per-element state follows the elements; the rest of a group's state (its step) is
    that of the saved group holding its first parameter, which every saved shard holds alike.

    :param files: the saved shards this rank reads (every shard :func:`reshard_reads` names,
        at least one), each as (path, document).
    """
    group_of = {param: group for group, flat in enumerate(saved.groups) for param in flat.params}
    reads = reshard_reads(saved, current, shard)
    values, states = [], []
    for into, like in enumerate(masters):
        template_group = group_of[current.groups[into].params[0]]
        template = files[min(files)][1]["optimizer_state"][template_group]
        keys = per_element_keys(template, saved.groups[template_group].shard_numel)
        value = torch.zeros_like(like)
        state = {key: torch.zeros(like.shape, dtype=item.dtype, device=like.device) if key in keys else whole(item)
                 for key, item in template.items()}
        for read in (read for read in reads if read.into == into):
            path, document = files[read.shard]
            numel = saved.groups[read.group].shard_numel
            _copy(_flat(document["masters"][read.group], numel, path, f"master values of flat group {read.group}"),
                  read, value)
            group_state = document["optimizer_state"][read.group]
            for key in keys:
                if key not in group_state:
                    raise InvalidArgumentError(
                        f"{path}: the optimizer state of flat group {read.group} lacks {key!r}, which flat group "
                        f"{template_group} has: the checkpoint is inconsistent; restore it from a backup or save again")
                _copy(_flat(group_state[key], numel, path, f"{key!r} of flat group {read.group}"), read, state[key])
        values.append(value)
        states.append(state)
    return values, states


def _flat(value: object, numel: int, path: str, what: str) -> object:
    """``value``, after checking that it is a shard's flat tensor of ``numel`` elements."""
    if not is_tensor(value) or tuple(value.shape) != (numel,):
        shape = list(value.shape) if is_tensor(value) else type(value).__name__
        raise InvalidArgumentError(f"{path}: {what} is {shape}, not the {numel} elements its shard holds; restore it "
                                   "from a backup or save again")
    return value


def _copy(source: object, read: Read, target: torch.Tensor) -> None:
    """Elements ``[read.begin, read.end)`` of ``source`` into ``target`` at ``read.offset``:
    read straight into place where ``target`` is a host tensor of the file's dtype, else a
    block of :data:`READ_ELEMENTS` at a time."""
    place = target[read.offset:read.offset + read.end - read.begin]
    if isinstance(source, StoredTensor) and place.dtype == source.dtype and place.device.type == "cpu":
        source.read(0, read.begin, read.end, out=place)
        return
    for begin in range(read.begin, read.end, READ_ELEMENTS):
        end = min(read.end, begin + READ_ELEMENTS)
        rows = source.read(0, begin, end) if isinstance(source, StoredTensor) else source[begin:end]
        target[read.offset + begin - read.begin:read.offset + end - read.begin].copy_(rows)
