"""The collectives ZeRO runs, on its process set's engine channel (:mod:`psrt.engine.channel`):
every one is named, and the gradient reductions and gathers are asynchronous.

A group's name is the same on every rank (it comes from the wrap order and the
group index), so the engine matches each rank's call with the others' by name
whatever order backward produced the gradients in.

Over a set of one rank there is nothing to exchange or agree on: a reduction is its input
(the average over one rank) and a gather a copy of the shard, done here on the calling
thread, and the engine sees no work.  Callers wait on what these functions return with
:func:`wait`, whichever it is.
"""
from __future__ import annotations

import torch

from psrt.comm.base import Communicator, ElementwiseOp
from psrt.engine import Channel, Work

_PIECES_TAG = 41  # exchange(): the messages of one work, between two ranks, matched in order


class Done:
    """The result of a collective over one rank, complete when made."""

    __slots__ = ("output",)

    def __init__(self, output: torch.Tensor) -> None:
        self.output = output


Started = Work | Done


def wait(channel: Channel, started: Started) -> object:
    """The output of what :func:`reduce_gradients` or :func:`gather` started."""
    return started.output if type(started) is Done else channel.wait(started)


def reduce_gradients(channel: Channel, flat: torch.Tensor, name: str, num_shards: int, wake: bool,
                     out: torch.Tensor | None = None) -> Started:
    """Start averaging ``flat`` (a whole group's gradients, padded to a multiple of the shards)
    over the set; the output is this rank's shard (in ``out`` if given), or the whole averaged
    group, ``flat`` itself, where the group is not sharded (stage 0).  ``wake``: see
    :meth:`Channel.start`."""
    if channel.size == 1:
        return Done(flat if out is None or out is flat else out.copy_(flat))
    if num_shards == 1:
        work = channel.allreduce([flat], name=name, scale=1.0 / channel.size, finish=lambda _: flat)
    else:
        shard = flat.numel() // channel.size
        if out is None:
            out = torch.empty(shard, dtype=flat.dtype, device=flat.device)
        work = channel.reduce_scatter(flat, out, [shard] * channel.size, name=name, scale=1.0 / channel.size)
    return channel.start(work, wake)


def gather(channel: Channel, shard: torch.Tensor, full: torch.Tensor, name: str) -> Started:
    """Start gathering every rank's ``shard`` into ``full``, in rank order."""
    if channel.size == 1:
        return Done(full.copy_(shard))
    return channel.start(channel.allgather_into(shard, full, name=name))


def total_norm(channel: Channel, partial: torch.Tensor, norm_type: float, sharded: bool) -> torch.Tensor:
    """Combine this rank's partial norm statistic (sum of |g|^p, or max |g| for inf) over the set.

    Unsharded gradients (stage 0) are the same on every rank and are not combined.
    """
    if sharded and channel.size > 1:
        partial = partial.clone()
        op = ElementwiseOp.MAX if norm_type == float("inf") else ElementwiseOp.SUM
        channel.run(channel.allreduce([partial], name="zero.grad_norm", op=op))
    return partial if norm_type == float("inf") else partial ** (1.0 / norm_type)


def any_rank(channel: Channel, flags: list[torch.Tensor], name: str) -> bool:
    """True if any of ``flags`` (0-dim bool tensors, on the gradients' device) is true on any
    rank of the set: one small allreduce on the device, then one read of its result, the host
    wait a loss scaler needs to decide whether the step is taken (as torch's ``GradScaler``).
    Over one rank, only that read."""
    value = torch.stack(flags).any().to(torch.int32).reshape(1) if flags else torch.zeros(1, dtype=torch.int32)
    if channel.size > 1:
        channel.run(channel.allreduce([value], name=name, op=ElementwiseOp.MAX))
    return bool(value)


def exchange(channel: Channel, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
             name: str) -> None:
    """Send each ``(tensor, set rank)`` of ``sends`` and receive into each ``(tensor, set rank)``
    of ``recvs`` (host tensors, contiguous), as one named work, and wait for it.  Every rank
    of the set calls it with the same name, even with nothing to send or receive; between two
    ranks, the sender's tensors fill the receiver's in the order each lists them."""
    if channel.size == 1:
        return

    def run(host: Communicator, data: Communicator) -> None:
        host.isendrecv(sends, recvs, _PIECES_TAG).wait()

    channel.run(channel.execute("exchange", name, (), torch.device("cpu"), run))
