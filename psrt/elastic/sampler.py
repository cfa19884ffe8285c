"""``ElasticSampler``: the samples of an epoch not yet processed, sharded over the ranks of
the current launch, so that a job relaunched at another size resumes mid-epoch.

The epoch's order is one permutation of the whole dataset (seeded by ``seed + epoch``);
the remaining samples keep their places in it.  So a job relaunched at the same size sees
exactly the batches it would have seen, and at any size a global step of ``B`` samples
takes the same ``B`` samples: rank ``r`` of ``n`` reads positions ``r, r + n, ...`` of
the remaining order, and batch ``k`` of ``b`` samples per rank covers positions
``[k*b*n, (k+1)*b*n)``.  :meth:`record_batch` marks that whole span as processed on every
rank without communication (every rank takes its step together); :meth:`record_indices`,
Horovod's other form, marks only this rank's and the ranks' records are joined at
``sync()``.  Like ``DistributedSampler``, the order is padded to a multiple of the rank
count by repeating its first samples.
"""
from __future__ import annotations

import math

import torch

from psrt import runtime
from psrt.errors import InvalidArgumentError


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)``: pass it to a
    ``DataLoader`` and to ``TorchState``; call :meth:`set_epoch` at the start of each epoch
    and :meth:`record_batch` after each step."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.processed = torch.zeros(len(dataset), dtype=torch.bool)
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: every sample is unprocessed again, in that epoch's order."""
        self.epoch = epoch
        self.processed.zero_()
        self.reset()

    def reset(self) -> None:
        """Shard the remaining samples over the ranks of this launch (called on restore and sync)."""
        self.num_replicas = runtime.size() if runtime.is_initialized() else 1
        self.rank = runtime.rank() if runtime.is_initialized() else 0
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator)
        else:
            order = torch.arange(len(self.dataset))
        self.remaining = order[~self.processed[order]]
        self.num_samples = math.ceil(len(self.remaining) / self.num_replicas)
        padded = self.num_samples * self.num_replicas
        repeats = math.ceil(padded / max(len(self.remaining), 1))
        self.order = self.remaining.repeat(repeats)[:padded] if len(self.remaining) else self.remaining
        self.indices = self.order[self.rank::self.num_replicas].tolist()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark batch ``batch_idx`` (of ``batch_size`` samples per rank, counted from the last
        reset) as processed on every rank."""
        if batch_idx < 0 or batch_size <= 0:
            raise InvalidArgumentError(f"record_batch({batch_idx}, {batch_size}): the batch index must be >= 0 "
                                       "and the batch size > 0")
        span = self.num_replicas * batch_size
        self.processed[self.order[batch_idx * span:(batch_idx + 1) * span]] = True

    def record_indices(self, indices) -> None:
        """Mark ``indices`` (dataset indices this rank processed) as processed; the ranks'
        marks are joined at the next ``sync()``."""
        self.processed[torch.as_tensor(list(indices), dtype=torch.long)] = True

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch ``batch_idx``."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed": self.processed.clone()}

    def load_state_dict(self, state: dict) -> None:
        processed = state["processed"]
        if processed.shape != self.processed.shape:
            raise InvalidArgumentError(f"the sampler state covers {processed.numel()} samples, this dataset has "
                                       f"{len(self.dataset)}")
        self.epoch = int(state["epoch"])
        self.processed = processed.clone().bool()
        self.reset()
