"""How a tensor-parallel parameter relates to the full (single-process) tensor.

Each sharded parameter carries a :class:`Sharding` as ``param.tp_sharding``;
loading a full ``state_dict`` into TP layers and gathering it back use only
that description, so any module built from psrt's TP layers works with them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from psrt.errors import InvalidArgumentError


@dataclass(frozen=True)
class Sharding:
    """``dim`` of the full tensor (``full_size`` long, padded up to ``parts`` equal blocks
    per stride part) is split over ``parts`` ranks; this rank holds block ``index``.

    ``stride`` > 1 describes fused outputs (q, k and v in one matrix, Megatron's stride):
    the full dimension is ``stride`` equal parts and each is split separately.
    """

    dim: int
    parts: int
    index: int
    full_size: int
    stride: int = 1

    @property
    def padded_size(self) -> int:
        unit = self.parts * self.stride
        return -(-self.full_size // unit) * unit

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of the full tensor (padding with zeros where needed)."""
        if full.shape[self.dim] != self.full_size:
            raise InvalidArgumentError(f"expected size {self.full_size} along dim {self.dim}, got a tensor "
                                       f"of shape {tuple(full.shape)}")
        pad = self.padded_size - self.full_size
        if pad:
            widths = [0, 0] * (full.dim() - 1 - self.dim % full.dim()) + [0, pad]
            full = nn.functional.pad(full, widths)
        parts = full.chunk(self.stride, self.dim)
        return torch.cat([part.chunk(self.parts, self.dim)[self.index] for part in parts], self.dim)

    def source_ranges(self) -> list[tuple[int, int, int]]:
        """Where this rank's block lies in the full tensor along ``dim``: for each stride part,
        ``(begin, end, length)``, the block holding ``length`` rows of which those past
        ``full_size`` (``end - begin`` fewer) are padding.  What a reader of one slice needs."""
        part = self.padded_size // self.stride
        block = part // self.parts
        starts = [s * part + self.index * block for s in range(self.stride)]
        return [(min(start, self.full_size), min(start + block, self.full_size), block) for start in starts]

    def unshard(self, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's block, in rank order (padding removed)."""
        per_rank = [block.chunk(self.stride, self.dim) for block in blocks]
        parts = [torch.cat([pieces[s] for pieces in per_rank], self.dim) for s in range(self.stride)]
        return torch.cat(parts, self.dim).narrow(self.dim, 0, self.full_size)


def shard_parameter(full: torch.Tensor, sharding: Sharding) -> nn.Parameter:
    """A parameter holding ``sharding``'s block of ``full``, tagged with the sharding."""
    param = nn.Parameter(sharding.shard(full).clone())
    param.tp_sharding = sharding
    return param


def sharding_of(tensor: torch.Tensor) -> Sharding | None:
    return getattr(tensor, "tp_sharding", None)
