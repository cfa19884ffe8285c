"""``ElasticSampler``: the samples of an epoch not yet processed, sharded over the ranks of
the current launch, so that a job relaunched at another size resumes mid-epoch.

The semantics are Horovod's, so that a Horovod script resumed under psrt skips and reads the
samples it would under Horovod.  The epoch's order is ``range(len(dataset))`` shuffled by
``random.Random(seed + epoch)`` (kept as is with ``shuffle=False``).  ``processed_num``
counts the samples of that order already taken: :meth:`record_batch` adds
``batch_size * num_replicas`` to it, whatever the batch index, and :meth:`set_epoch` sets it
back to 0.  The rest of the order, ``order[processed_num:]``, is padded to a multiple of the
rank count by repeating its first samples, as ``DistributedSampler`` does, and rank ``r`` of
``n`` reads its positions ``r, r + n, ...``.  So batch ``k`` of ``b`` samples per rank covers
positions ``[k*b*n, (k+1)*b*n)`` of what remains: a job relaunched at the same size sees
exactly the batches it would have seen, and at any size a global step of ``B`` samples takes
the same ``B`` samples.

psrt also keeps :meth:`record_indices`, Horovod's earlier form: it marks single dataset
indices (``processed``), which every rank skips once the ranks' marks are joined at
``sync()``.
"""
from __future__ import annotations

import math
import random

import torch

from psrt import runtime
from psrt.errors import InvalidArgumentError


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)``: pass it to a
    ``DataLoader`` and to ``TorchState``; call :meth:`record_batch` after each step and
    :meth:`set_epoch` when an epoch is over."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.processed = torch.zeros(len(dataset), dtype=torch.bool)
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: every sample is unprocessed again, in that epoch's order."""
        self.epoch = epoch
        self.processed_num = 0
        self.processed.zero_()
        self.reset()

    def reset(self) -> None:
        """Shard the remaining samples over the ranks of this launch (called on restore and sync)."""
        self.num_replicas = runtime.size() if runtime.is_initialized() else 1
        self.rank = runtime.rank() if runtime.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        untaken = torch.tensor(order[self.processed_num:], dtype=torch.long)
        self.remaining = untaken[~self.processed[untaken]]
        self.num_samples = math.ceil(len(self.remaining) / self.num_replicas)
        padded = self.num_samples * self.num_replicas
        repeats = math.ceil(padded / max(len(self.remaining), 1))
        padded_order = self.remaining.repeat(repeats)[:padded] if len(self.remaining) else self.remaining
        self.indices = padded_order[self.rank::self.num_replicas].tolist()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one step of ``batch_size`` samples per rank as processed on every rank
        (``batch_size * num_replicas`` more samples of the epoch's order), as Horovod does:
        the batch index is not used."""
        if batch_size <= 0:
            raise InvalidArgumentError(f"record_batch({batch_idx}, {batch_size}): the batch size must be > 0")
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices) -> None:
        """Mark ``indices`` (dataset indices this rank processed) as processed; the ranks'
        marks are joined at the next ``sync()``."""
        self.processed[torch.as_tensor(list(indices), dtype=torch.long)] = True

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch ``batch_idx`` (counted from the last reset)."""
        return self.indices[batch_idx * batch_size:(batch_idx + 1) * batch_size]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num, "processed": self.processed.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Take a state from :meth:`state_dict`, or Horovod's (``epoch`` and ``processed_num``)."""
        processed = state.get("processed", torch.zeros(len(self.dataset), dtype=torch.bool))
        if processed.shape != self.processed.shape:
            raise InvalidArgumentError(f"the sampler state covers {processed.numel()} samples, this dataset has "
                                       f"{len(self.dataset)}")
        self.epoch = int(state["epoch"])
        self.processed_num = int(state.get("processed_num", 0))
        self.processed = processed.clone().bool()
        self.reset()
