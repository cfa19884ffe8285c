"""``DistributedOptimizer``'s bucket strategy: a bucket's gradients averaged over the process set,
in place, on its engine channel (see :mod:`psrt.dp.reducer` for when a bucket is launched and
finished)."""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from psrt.dp import Bucket, BucketStrategy, whole_buffer
from psrt.engine import Channel, Work
from psrt.torch.collectives.allreduce import AllreduceCall, allreduce_call, allreduce_work
from psrt.torch.collectives.grouped_allreduce import start_sparse_allreduce
from psrt.torch.ops import ReduceOp


class _Reduction:
    """What a bucket's reduction started: the dense tensors reduced in place (the bucket buffer,
    or its members' gradients) and the work reducing them, their compression contexts, dense
    copies standing for sparse gradients (``sparse_as_dense``), and the allgathers of sparse
    ones."""

    __slots__ = ("dense", "work", "ctxs", "densified", "sparse")

    def __init__(self) -> None:
        self.dense: list[torch.Tensor] = []
        self.work: Work | None = None
        self.ctxs: list[object] = []
        self.densified: list[tuple[torch.Tensor, torch.Tensor]] = []  # (dense copy, the sparse gradient)
        self.sparse: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []


class Averaging(BucketStrategy):
    """DistributedOptimizer's bucket: its gradients averaged (``op=Sum``: summed) over the set,
    in place, on the set's channel.  With views the bucket buffer is one allreduce; otherwise
    the members' gradients are one grouped allreduce.  A sparse gradient is allgathered
    (Horovod's sparse allreduce) or, with ``sparse_as_dense``, reduced as a dense copy."""

    def __init__(self, channel: Channel, *, op: ReduceOp, scales: tuple[float, float], compression: object,
                 sparse_as_dense: bool, names: Mapping[torch.Tensor, str]) -> None:
        """``scales`` are the prescale and postscale factors; ``names`` each parameter's name,
        for its sparse gradient's allgathers."""
        self.channel, self.op, self.scales, self.compression = channel, op, scales, compression
        self.sparse_as_dense, self.names = sparse_as_dense, names
        self._calls: dict[tuple, AllreduceCall] = {}  # by bucket and layout: worked out once

    def launch(self, bucket: Bucket) -> None:
        reduction = bucket.started = _Reduction()
        whole = whole_buffer(bucket)
        for slot, param in enumerate(bucket.params):
            grad = param.grad
            if not grad.is_sparse:
                if not whole:
                    reduction.dense.append(grad)
            elif self.sparse_as_dense:
                dense = bucket.views[slot].copy_(grad.to_dense()) if whole else grad.to_dense()
                reduction.densified.append((dense, grad))
                if not whole:
                    reduction.dense.append(dense)
            else:
                name = f"{bucket.name}.{self.names[param]}"
                reduction.sparse.append((grad, start_sparse_allreduce(self.channel, grad, name, self.op)))
        if whole and len(reduction.sparse) < len(bucket.params):
            reduction.dense.append(bucket.buffer)
        if not reduction.dense:
            return
        packed = [self.compression.compress(tensor) for tensor in reduction.dense]
        reduction.ctxs = [ctx for _, ctx in packed]
        wires = [wire for wire, _ in packed]
        call = self._call(bucket, wires)
        reduction.work = self.channel.start(allreduce_work(call, wires, in_place=True, grouped=True),
                                            wake=not bucket.awaited)

    def _call(self, bucket: Bucket, wires: list[torch.Tensor]) -> AllreduceCall:
        key = (bucket.index, *[(t.dtype, t.shape) for t in wires])
        call = self._calls.get(key)
        if call is None:
            call = self._calls[key] = allreduce_call(self.channel, wires, True, bucket.name, self.op, None,
                                                     *self.scales)
        return call

    def finish(self, bucket: Bucket) -> None:
        reduction = bucket.started
        if reduction is None:  # its launch failed before starting anything
            return
        outputs = self.channel.wait(reduction.work) if reduction.work is not None else []
        for tensor, wire, ctx in zip(reduction.dense, outputs, reduction.ctxs):
            reduced = self.compression.decompress(wire, ctx)
            if reduced is not tensor:
                tensor.copy_(reduced)
        for dense, target in reduction.densified:  # given back sparse, as in Horovod
            target.zero_().add_(dense.to_sparse(target.sparse_dim()))
        for grad, result in reduction.sparse:
            grad.zero_().add_(result())
