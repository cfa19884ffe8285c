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
process set's engine channel (over one rank, local copies).

Over one rank, stages 2 and 3 keep the reduced gradient shard's buffer across steps: the
first reduction of a step copies the gradients into it once (the whole reduction), later ones
(accumulation) add to it.  Over several ranks each reduction writes a shard of its own: a
reduce-scatter into the kept buffer (which the optimizer also reads as the master's gradient)
made stage-2 and stage-3 steps 10-15 % slower on the 2-core VM (benchmarks/RESULTS.md, ZeRO).
The whole group's gradients are copied once into a flat buffer made for that reduction, whose
padding is zeroed in place; keeping that one would hold the unsharded gradients between
steps, which is what stages 2 and 3 save.
"""
from __future__ import annotations

import torch

from psrt.engine import Channel
from psrt.zero import comm
from psrt.zero.partition import Partition
from psrt.zero.released import classes_of, name_parameter


class GatheredBytes:
    """Bytes of stage-3 parameter buffers gathered now, and the most at any time, kept by
    the groups as they gather (add) and release (subtract)."""

    __slots__ = ("now", "peak")

    def __init__(self) -> None:
        self.now = self.peak = 0


class ShardedGroup:
    """A flat group's tensors on this rank; ``shard`` is this rank's index among ``num_shards``.
    ``keep_grad_buffer``: keep the reduced gradient shard's buffer across steps (stages 2-3,
    whose gradients are reduced during backward); ``meter``: stage 3's count of gathered bytes,
    which this group's gathers and releases keep."""

    def __init__(self, name: str, partition: Partition, index: int, params: list[torch.nn.Parameter],
                 shard: int, channel: Channel, compute_dtype: torch.dtype | None,
                 gathered_on_demand: bool, keep_grad_buffer: bool = False,
                 meter: GatheredBytes | None = None) -> None:
        self.name, self.flat, self.params = name, partition.groups[index], params
        self.num_shards, self.channel = partition.num_shards, channel
        self.gathered_on_demand, self.meter = gathered_on_demand, meter or GatheredBytes()
        start, stop = partition.shard_range(index, shard)
        with torch.no_grad():
            values = torch.zeros(partition.padded_numel(index), dtype=params[0].dtype, device=params[0].device)
            for param, offset in zip(params, self.flat.offsets):
                values[offset:offset + param.numel()] = param.reshape(-1)
        self.compute_dtype = compute_dtype or values.dtype
        self.full = values.to(self.compute_dtype)
        self.nbytes = self.full.numel() * self.full.element_size()
        # Stage 3 keeps its shard apart from ``full``, whose storage comes and goes.
        self.shard = self.full[start:stop].clone() if gathered_on_demand else self.full[start:stop]
        self.master = values[start:stop].clone() if self.compute_dtype != values.dtype else self.shard
        for param, offset, index in zip(params, self.flat.offsets, self.flat.params):
            param.data = self.full[offset:offset + param.numel()].view(param.shape)
            name_parameter(param, partition.params[index].name)
        # each parameter's own class and the class it takes while released
        self._classes = [(param, *classes_of(param)) for param in params]
        self.grad: torch.Tensor | None = None  # this rank's reduced gradient shard, compute dtype
        # where the first reduction of each step puts it (stages 2-3, which keep only the shard)
        self.grad_buffer = (torch.zeros(stop - start, dtype=self.compute_dtype, device=self.full.device)
                            if keep_grad_buffer else None)
        self._gather: comm.Started | None = None  # a gather in flight
        self.gathered = True   # ``full`` holds memory (its values, once the gather in flight is done)
        self.readable = True   # the parameters have their own classes
        if gathered_on_demand:
            self.meter.now += self.nbytes  # counted as gathered, so that releasing it balances
            self.release()

    # -- gradients ------------------------------------------------------------------
    def start_reduction(self, wake: bool = True) -> comm.Started:
        """Start averaging this rank's gradients of the group over the set (``wake``: see
        :meth:`psrt.engine.Channel.start`); :meth:`finish_reduction` takes what it returns.

        Parameters without a gradient count as zeros.  The parameters' ``.grad`` are dropped:
        from here on the group's gradient lives in its shard only.
        """
        with torch._C.DisableTorchFunctionSubclass():  # a released parameter's .grad, without its checks
            grads = [param.grad for param in self.params]
            for param in self.params:
                param.grad = None
        first = self.grad is None
        if self.channel.size == 1:  # the average over one rank is the gradient itself
            if not first:
                self._into(self.grad, grads, accumulate=True)
                return comm.Done(self.grad)
            flat = self.grad_buffer if self.grad_buffer is not None else self._flat()
            self._into(flat, grads, accumulate=False)
            return comm.Done(flat)
        flat = self._flat()
        if self.flat.numel < flat.numel():
            flat[self.flat.numel:].zero_()
        self._into(flat, grads, accumulate=False)
        return comm.reduce_gradients(self.channel, flat, f"{self.name}.grad", self.num_shards, wake,
                                     out=self.grad_buffer if first else None)

    def _flat(self) -> torch.Tensor:
        return torch.empty(self.full.numel(), dtype=self.compute_dtype, device=self.full.device)

    def _into(self, flat: torch.Tensor, grads: list[torch.Tensor | None], accumulate: bool) -> None:
        """Copy (or add) the gradients into ``flat``'s first elements, in one pass."""
        head = flat[:self.flat.numel]
        missing = [slot for slot, grad in enumerate(grads) if grad is None]
        if not missing and not accumulate:
            torch.cat([grad.reshape(-1) for grad in grads], out=head)
            return
        pieces = head.split([param.numel() for param in self.params])
        present = [slot for slot, grad in enumerate(grads) if grad is not None]
        if present:
            apply = torch._foreach_add_ if accumulate else torch._foreach_copy_
            apply([pieces[slot] for slot in present], [grads[slot].reshape(-1) for slot in present])
        if not accumulate:
            for slot in missing:
                pieces[slot].zero_()

    def finish_reduction(self, started: comm.Started) -> None:
        """Add the reduced shard to the gradient accumulated in this step (if any)."""
        reduced = comm.wait(self.channel, started)
        if self.grad is None:
            self.grad = reduced
        elif reduced is not self.grad:
            self.grad.add_(reduced)

    # -- parameters -----------------------------------------------------------------
    def publish_local(self) -> None:
        """Copy the master into the compute shard, where they are separate tensors."""
        if self.master is not self.shard:
            with torch.no_grad():
                self.shard.copy_(self.master)

    def publish(self, values: torch.Tensor | None = None) -> comm.Started | None:
        """After the optimizer step: update the compute shard and, where every rank keeps the
        whole group (stages 1 and 2), start gathering the shards; returns what to wait on.
        ``values``: the master's values in a tensor of their own, which nothing changes until
        the gather is done (a restore's), sent instead of a copy of the shard."""
        self.publish_local()
        if self.gathered_on_demand or self.num_shards == 1:
            return None
        sent = self.shard.clone() if values is None else values.to(self.compute_dtype)
        return comm.gather(self.channel, sent, self.full, f"{self.name}.param")

    @property
    def is_gathered(self) -> bool:
        return self.gathered

    def start_gather(self) -> None:
        """Allocate ``full`` and start gathering every shard into it (stage 3); idempotent."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.nbytes)
        self.gathered = True
        meter = self.meter
        meter.now += self.nbytes
        if meter.now > meter.peak:
            meter.peak = meter.now
        self._gather = comm.gather(self.channel, self.shard, self.full, f"{self.name}.param")

    def finish_gather(self) -> None:
        """Wait for the gather started last; from then on the parameters can be read."""
        if self._gather is not None:
            started, self._gather = self._gather, None
            comm.wait(self.channel, started)
        if self.gathered and not self.readable:
            for param, own, _ in self._classes:
                param.__class__ = own
            self.readable = True

    def release(self) -> None:
        """Free ``full`` (stage 3); the parameters keep their shapes but hold no memory, and
        reading one raises ``ParameterReleasedError`` until the group is gathered again."""
        if not self.gathered:
            return
        if self._gather is not None:
            started, self._gather = self._gather, None
            comm.wait(self.channel, started)
        if self.readable:
            for param, _, released in self._classes:
                param.__class__ = released
            self.readable = False
        self.full.untyped_storage().resize_(0)
        self.gathered = False
        self.meter.now -= self.nbytes

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()


def publish_all(groups: list[ShardedGroup], channel: Channel, values: list[torch.Tensor] | None = None) -> None:
    """:meth:`ShardedGroup.publish` every group (with its ``values``, if given) and wait for the
    gathers: the compute parameters then follow the masters, as after a step."""
    started = [group.publish(value) for group, value in zip(groups, values or [None] * len(groups))]
    for gather in started:
        if gather is not None:
            comm.wait(channel, gather)
