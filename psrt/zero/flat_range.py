"""A parameter-shaped tensor of which this rank holds a flat range, for
``torch.distributed.checkpoint`` (DCP): each box of the range (:mod:`psrt.zero.boxes`) is a
view of the shard, which DCP writes from and reads into.  It implements DCP's
``_Checkpointable`` protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``), as DTensor does, so DCP's default planners take it as they take
FSDP2's DTensors.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from psrt.errors import InvalidArgumentError, UnsupportedOperationError
from psrt.zero.boxes import Box


class FlatRangeShard(torch.Tensor):
    """A tensor of a parameter's shape of which this rank holds one flat range, as boxes that
    view a ZeRO shard (the master weights or an optimizer state).  It has no other values and
    supports no tensor operation: it exists to be saved and loaded by DCP (it implements
    DCP's ``_Checkpointable`` protocol, as DTensor does).  :mod:`psrt.zero.dcp` builds it from
    the parameter's shape, this rank's shard (1-D) and each box with the position of its first
    element in the shard.
    """

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], flat: torch.Tensor, boxes: list[tuple[Box, int]]) -> FlatRangeShard:
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=flat.dtype, device=flat.device)
        tensor._flat = flat
        tensor._views = {box.offsets: (box, flat[at:at + box.numel].view(box.sizes)) for box, at in boxes}
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise UnsupportedOperationError(
            f"{func} on a psrt FlatRangeShard: this rank holds only some boxes of the tensor (see .boxes); "
            "it is for saving and loading through torch.distributed.checkpoint")

    def __repr__(self) -> str:
        return f"FlatRangeShard(shape={tuple(self.shape)}, dtype={self.dtype}, boxes={self.boxes})"

    @property
    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, sizes)`` of the boxes this rank holds."""
        return [(box.offsets, box.sizes) for box, _ in self._views.values()]

    def local_views(self) -> list[torch.Tensor]:
        """The boxes' values: views of the shard, in flat order."""
        return [view for _, view in self._views.values()]

    def is_view_of(self, other: FlatRangeShard) -> bool:
        """Whether it views the same boxes of the same shard as ``other``."""
        return self._flat is other._flat and self.boxes == other.boxes

    # -- DCP's _Checkpointable protocol ------------------------------------------------------
    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(box.offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=_chunk(box), size=self.shape,
                                                      properties=TensorProperties.create_from_tensor(view)))
                for box, view in self._views.values()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(box) for box, _ in self._views.values()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        found = self._views.get(tuple(index.offset or ()))
        if found is None:
            raise InvalidArgumentError(f"{index.fqn}: this rank holds no box at offsets {tuple(index.offset or ())}, "
                                       f"only at {list(self._views)}")
        return found[1]


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
