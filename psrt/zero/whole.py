"""Whole parameters out of ZeRO-3's shards, each on one rank, never the model on one rank.

``save_pretrained`` from a ZeRO-3 model has every rank write a file of the parameters it
holds whole: :func:`psrt.zero.partition.writers` says which (no rank more than its shard plus
the largest parameter), and :func:`owned_parameters` assembles them from every rank's
pieces, one flat group at a time, by point-to-point messages over the optimizer's channel.
"""
from __future__ import annotations

import torch

from psrt.zero import comm
from psrt.zero.partition import writers


def owned_parameters(zero) -> dict[str, torch.Tensor]:
    """The trainable parameters this rank writes whole (:func:`writers`), by name, on the host
    in their own dtype, from the master values (fp32 masters under a lower compute dtype).

    Collective: every rank of ``zero``'s process set calls it, in the same order.  Stage 3
    only, where each rank holds its own shard.
    """
    partition, mine = zero.partition, zero.shard_index
    owner = writers(partition)
    owned = {param: torch.empty(info.numel, dtype=getattr(torch, info.dtype))
             for param, info in enumerate(partition.params) if owner[param] == mine}
    for index, group in enumerate(zero.groups):
        sends, recvs = [], []
        for shard in range(partition.num_shards):
            for piece in partition.pieces(index, shard):
                to = owner[piece.param]
                if shard == mine:
                    values = group.master[piece.shard_offset:piece.shard_offset + piece.stop - piece.start]
                    if to == mine:
                        owned[piece.param][piece.start:piece.stop].copy_(values)
                    else:
                        sends.append((values.detach().cpu(), to))
                elif to == mine:
                    recvs.append((owned[piece.param][piece.start:piece.stop], shard))
        comm.exchange(zero.channel, sends, recvs, f"{group.name}.whole")
    return {partition.params[param].name: value.view(partition.params[param].shape) for param, value in owned.items()}
