"""The part of a model one pipeline rank holds."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.pp.partition import balanced_split, explicit_split
from psrt.pp.tied import find_ties
from psrt.tp.recompute import check_mode, checkpoint
from psrt.topology import ProcessSet


class PipelineStage(nn.Module):
    """This rank's blocks of a model given as a list of blocks, one chunk (virtual stage)
    per entry of ``chunk_ranges``.

    Blocks keep their index in the full list as their name, so ``state_dict()`` keys
    equal those of ``nn.Sequential(*blocks)`` restricted to this rank's blocks.  With
    ``chunks`` = v the model is cut into p·v virtual stages and rank r holds stages
    r, r + p, ... (Megatron's interleaved layout).  ``split`` gives the number of blocks
    per virtual stage; otherwise the cut balances parameter counts.

    Every rank may build the whole list (so that one seed gives every rank the same
    weights as a single process); the blocks of other stages are simply not kept.

    ``recompute="full"`` keeps only each block's input per micro-batch in flight and
    runs the block again in its backward (every random stream replayed); for the
    attention-only ``"selective"`` recomputation, build the transformer blocks with it.

    A parameter that blocks on different ranks share (tied input and output embeddings:
    the same ``Parameter`` in the first and the last block) stays a parameter on the rank
    of its first use and becomes a synchronised copy on the others (see
    :mod:`psrt.pp.tied`); ``ties`` lists this rank's.
    """

    def __init__(self, blocks: Sequence[nn.Module], process_set: ProcessSet, *, chunks: int = 1,
                 split: Sequence[int] | None = None, recompute: str | None = None) -> None:
        super().__init__()
        if not isinstance(process_set, ProcessSet):
            raise ArgumentTypeError(f"process_set must be the pipeline ProcessSet, got {type(process_set).__name__}")
        blocks = list(blocks)
        if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
            raise ArgumentTypeError("blocks must be a non-empty sequence of torch.nn.Module")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise InvalidArgumentError(f"chunks must be a positive int, got {chunks!r}")
        self.recompute = check_mode(recompute, (None, "full"))
        self.process_set = process_set
        self.stages, self.rank, self.chunks = process_set.size(), process_set.rank(), chunks
        virtual = self.stages * chunks
        if split is None:
            sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
            ranges = balanced_split(sizes, virtual)
        else:
            ranges = explicit_split(len(blocks), split)
            if len(ranges) != virtual:
                raise InvalidArgumentError(f"split has {len(ranges)} entries, expected one per virtual stage "
                                           f"({self.stages} stages × {chunks} chunks = {virtual})")
        self.cut = tuple((r.start, r.stop) for r in ranges)  # every virtual stage's blocks: the stages must agree
        self.chunk_ranges = [ranges[c * self.stages + self.rank] for c in range(chunks)]
        self.ties, self.tied_aliases = find_ties(blocks, ranges, self.stages, self.rank)
        for chunk in self.chunk_ranges:
            for index in chunk:
                self.add_module(str(index), blocks[index])

    def run_chunk(self, chunk: int, x: torch.Tensor, kept: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Forward of the blocks of ``chunk``, in order.  With recomputation the input of
        each block is what stays alive for backward; ``kept`` collects them (autograd's
        saved-tensor hooks do not see what a recomputed region keeps)."""
        for index in self.chunk_ranges[chunk]:
            block = self._modules[str(index)]
            if self.recompute == "full":
                if kept is not None:
                    kept.append(x)
                x = checkpoint(block, x)
            else:
                x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.chunks != 1:
            raise InvalidArgumentError("an interleaved stage runs chunk by chunk; use run_chunk(chunk, x)")
        return self.run_chunk(0, x)

    def is_first(self, chunk: int) -> bool:
        return chunk == 0 and self.rank == 0

    def is_last(self, chunk: int) -> bool:
        return chunk == self.chunks - 1 and self.rank == self.stages - 1
