"""One flat group on this rank: the buffer its parameters view, this rank's shard, the master
copy the optimizer updates, and the gradient shard.

The parameters of a group become views of one flat buffer in the compute dtype
(``full``).  This rank's shard is a view of it (stages 0-2) or a tensor of its
own while ``full`` is released between uses (stage 3: its storage is resized to
zero, so the parameter views stay valid and autograd's saved references see
the values again once they are gathered back; while released, reading a
parameter raises instead of reading freed memory: ``psrt.zero.released``).  The master copy is the shard
itself unless a compute dtype is set, in which case it keeps the parameters'
own dtype (fp32 master weights).  Communication goes through ``psrt.zero.comm``, on the
process set's engine channel.
"""
from __future__ import annotations

import torch

from psrt.engine import Channel, Work
from psrt.zero import comm
from psrt.zero.partition import Partition
from psrt.zero.released import mark_gathered, mark_released, name_parameter


class ShardedGroup:
    """A flat group's tensors on this rank; ``shard`` is this rank's index among ``num_shards``."""

    def __init__(self, name: str, partition: Partition, index: int, params: list[torch.nn.Parameter],
                 shard: int, channel: Channel, compute_dtype: torch.dtype | None,
                 gathered_on_demand: bool) -> None:
        self.name, self.flat, self.params = name, partition.groups[index], params
        self.num_shards, self.channel = partition.num_shards, channel
        self.gathered_on_demand = gathered_on_demand
        start, stop = partition.shard_range(index, shard)
        with torch.no_grad():
            values = torch.zeros(partition.padded_numel(index), dtype=params[0].dtype, device=params[0].device)
            for param, offset in zip(params, self.flat.offsets):
                values[offset:offset + param.numel()] = param.reshape(-1)
        self.compute_dtype = compute_dtype or values.dtype
        self.full = values.to(self.compute_dtype)
        # Stage 3 keeps its shard apart from ``full``, whose storage comes and goes.
        self.shard = self.full[start:stop].clone() if gathered_on_demand else self.full[start:stop]
        self.master = values[start:stop].clone() if self.compute_dtype != values.dtype else self.shard
        for param, offset, index in zip(params, self.flat.offsets, self.flat.params):
            param.data = self.full[offset:offset + param.numel()].view(param.shape)
            name_parameter(param, partition.params[index].name)
        self.grad: torch.Tensor | None = None  # this rank's reduced gradient shard, compute dtype
        self._gather: Work | None = None       # an all-gather in flight
        if gathered_on_demand:
            self.release()

    # -- gradients ------------------------------------------------------------------
    def start_reduction(self, wake: bool = True) -> Work:
        """Start averaging this rank's gradients of the group over the set; returns the work
        (``wake``: see :meth:`psrt.engine.Channel.start`).

        Parameters without a gradient count as zeros.  The parameters' ``.grad`` are dropped:
        from here on the group's gradient lives in its shard only.
        """
        pieces = [param.grad.reshape(-1) if param.grad is not None else self._zeros(param.numel())
                  for param in self.params]
        pieces.append(self._zeros(self.full.numel() - self.flat.numel))
        flat = torch.cat(pieces)  # one pass over the gradients, no zeroing pass before it
        for param in self.params:
            param.grad = None
        return comm.reduce_gradients(self.channel, flat, f"{self.name}.grad", self.num_shards, wake)

    def _zeros(self, numel: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=self.compute_dtype, device=self.full.device)

    def finish_reduction(self, work: Work) -> None:
        """Add the reduced shard to the gradient accumulated in this step (if any)."""
        reduced = self.channel.wait(work)
        if self.grad is None:
            self.grad = reduced
        else:
            self.grad.add_(reduced)

    # -- parameters -----------------------------------------------------------------
    def publish_local(self) -> None:
        """Copy the master into the compute shard, where they are separate tensors."""
        if self.master is not self.shard:
            with torch.no_grad():
                self.shard.copy_(self.master)

    def publish(self) -> Work | None:
        """After the optimizer step: update the compute shard and, where every rank keeps the
        whole group (stages 1 and 2), start gathering the shards; returns the work."""
        self.publish_local()
        if self.gathered_on_demand or self.num_shards == 1:
            return None
        return comm.gather(self.channel, self.shard.clone(), self.full, f"{self.name}.param")

    @property
    def is_gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def start_gather(self) -> None:
        """Allocate ``full`` and start gathering every shard into it (stage 3); idempotent."""
        if self.is_gathered:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self._gather = comm.gather(self.channel, self.shard, self.full, f"{self.name}.param")

    def finish_gather(self) -> None:
        """Wait for the gather started last; from then on the parameters can be read."""
        self._wait_gather()
        if self.is_gathered:
            for param in self.params:
                mark_gathered(param)

    def _wait_gather(self) -> None:
        if self._gather is not None:
            work, self._gather = self._gather, None
            self.channel.wait(work)

    def release(self) -> None:
        """Free ``full`` (stage 3); the parameters keep their shapes but hold no memory, and
        reading one raises ``ParameterReleasedError`` until the group is gathered again."""
        self._wait_gather()
        for param in self.params:
            mark_released(param)
        self.full.untyped_storage().resize_(0)

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()
