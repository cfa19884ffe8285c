"""``DistributedOptimizer``: Horovod's data-parallel optimizer wrapper, with DDP's gradient buckets.

Every rank computes gradients on its own batch; the wrapper averages them over
the process set before the wrapped optimizer's step.  Parameters are split
into buckets (planned by :mod:`psrt.dp.buckets`, in the order backward completes their
gradients), and each bucket's allreduce starts during backward as soon as its
last gradient is accumulated, so communication overlaps the rest of backward.

The hooks, readiness counting, bucket launch and end-of-step wait are the
gradient reducer's (:mod:`psrt.dp.reducer`, shared with ZeRO and the parameter
server); this module says what a bucket's communication is: an allreduce, in place,
started on the process set's engine channel (:mod:`psrt.engine.channel`) and waited on.
Each bucket owns one flat buffer that its parameters' ``.grad`` can be views of (DDP's
``gradient_as_bucket_view``).  ``zero_grad()`` behaves as torch's: after it, ``.grad``
is None and backward makes fresh gradients, which are reduced where they lie (large
ones) or packed (small ones), with no copy into the buffer; after
``zero_grad(set_to_none=False)`` the gradients are zeroed in place as views of the buffer,
autograd accumulates into it, and each bucket travels as one contiguous tensor.
``op=hvd.Adasum`` and compressors other than ``Compression.none`` and
``Compression.fp16`` keep autograd's own tensors, each reduced as it is in a grouped
allreduce.

Sparse gradients (``nn.Embedding(sparse=True)``) are reduced as Horovod
reduces them: by default each is allgathered (indices and values) and stays
sparse; with ``sparse_as_dense`` it is reduced densely in its bucket and
given back sparse.  With ``op=hvd.Adasum`` the wrapper is Horovod's Adasum
optimizer: ``step()`` takes a local step and moves the parameters by the
Adasum of every rank's change.

Every rank must build the same model and wrap it the same way (the same
parameters, named the same, in the same order): bucket names and contents
must agree across ranks, and a parameter's gradient must be sparse on every
rank or on none.
"""
from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch

from psrt import runtime
from psrt.dp import Bucketing, GradientReducer, Slot, check_names, overlap_pays_here, plan_buckets, split_evenly
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import adasum
from psrt.torch.averaging import Averaging
from psrt.torch.collectives.allreduce import allreduce_call, allreduce_work
from psrt.torch.compression import Compression, compressor
from psrt.torch.ops import Adasum, Average, Sum

__all__ = ["Bucketing", "DistributedOptimizer"]
_ZERO_GRAD_IN_FLIGHT = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                        "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1, op=Average,
                         gradient_predivide_factor: float = 1.0, groups=None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *,
                         bucketing: Bucketing = Bucketing()) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` first averages (``op=Sum``: sums) gradients over
    ``process_set``; returns an instance of the optimizer's own class, with Horovod's
    arguments and meaning.

    A sparse gradient is allgathered and stays sparse (Average divides its values by the set
    size; entries are not coalesced), or with ``sparse_as_dense`` is reduced densely and given
    back sparse.  ``op=hvd.Adasum`` makes ``step()`` Horovod's Adasum step: a local step of the
    wrapped optimizer, then the parameters move by the Adasum of the ranks' parameter changes.

    The wrapper shares ``param_groups``, ``state`` and ``defaults`` with ``optimizer``: use the
    returned object from then on.  Parameters must be in the optimizer, and trainable, when it is
    wrapped.  ``zero_grad(set_to_none=True)`` behaves as torch's: gradients become None (the
    default) or are zeroed in place.  ``_parameter_names`` maps each parameter to its name.

    Collective: every rank of ``process_set`` wraps the same model the same way (same
    parameters, names and order, and in the same order as its other ``DistributedOptimizer``
    wrappers over that set), then calls ``step()`` (or ``synchronize()``), in the same order.
    A rank outside ``process_set`` gets a plain local optimizer, as in Horovod.

    :param optimizer: the torch optimizer to wrap (not already a ``DistributedOptimizer``),
        holding every parameter to train; add no parameter group afterwards.
    :param named_parameters: ``(name, parameter)`` pairs, e.g. ``model.named_parameters()``,
        naming every parameter of the optimizer with unique names; default None: Horovod's
        ``allreduce.noname.<group>.<index>``.
    :param compression: how gradients travel: ``hvd.Compression.none`` (the default) or
        ``hvd.Compression.fp16``, or any object with ``compress`` and ``decompress``.
    :param backward_passes_per_step: backward passes accumulated locally before one reduction
        (an int >= 1; default 1).  More backward passes than this before ``step()`` is an error.
    :param op: ``hvd.Average`` (the default), ``hvd.Sum`` or ``hvd.Adasum``; Adasum needs
        floating-point parameters and a process set whose size is a power of two.
    :param gradient_predivide_factor: with ``op=hvd.Average``, gradients are divided by this
        before the sum and by ``size / factor`` after it (a number; default 1.0; only with
        Average).
    :param groups: how gradients are grouped into reductions: None (the default: buckets by
        ``bucketing``), a positive number of equal runs of parameters, or a list of lists of
        parameters, each group reduced as one (parameters not listed are reduced alone).
    :param sparse_as_dense: reduce sparse gradients as dense tensors (given back sparse);
        default False: they are allgathered.
    :param process_set: the ranks to average over: a registered process set; default
        ``global_process_set`` (every rank).
    :param bucketing: psrt's addition: a :class:`Bucketing` with the bucket sizes and whether
        communication overlaps backward (default ``Bucketing()``: overlap where it can pay, see
        ``psrt.dp.overlap_pays``).  Keyword only.
    :returns: the wrapper, an instance of ``type(optimizer)``.
    """
    _check_arguments(optimizer, compression, backward_passes_per_step, op, gradient_predivide_factor,
                     sparse_as_dense, bucketing)
    cls = _wrapped_class(type(optimizer))
    wrapped = cls.__new__(cls)
    # An LR scheduler patches ``step`` on the instance it was given; that patch belongs to the original.
    wrapped.__dict__.update((key, value) for key, value in vars(optimizer).items() if key != "step")
    wrapped._setup_distributed(named_parameters, compression, backward_passes_per_step, op,
                               gradient_predivide_factor, groups, sparse_as_dense, process_set, bucketing)
    return wrapped


def _check_arguments(optimizer, compression, backward_passes_per_step, op, gradient_predivide_factor,
                     sparse_as_dense, bucketing) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    compressor(compression)
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an int >= 1, got {backward_passes_per_step!r}")
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"op must be hvd.Average, hvd.Sum or hvd.Adasum for gradients, got {op!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be a bool, got {sparse_as_dense!r}")
    if not isinstance(bucketing, Bucketing):
        raise TypeError(f"bucketing must be a psrt.torch.Bucketing, got {type(bucketing).__name__}")


@functools.lru_cache(maxsize=None)
def _wrapped_class(base: type) -> type:
    """One subclass per optimizer class, so ``isinstance(wrapped, base)`` holds."""
    return type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__})


class _DistributedOptimizer:
    """The methods a wrapped optimizer's class gets in front of its own (see DistributedOptimizer)."""

    def _setup_distributed(self, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, groups, sparse_as_dense, process_set, bucketing) -> None:
        current = runtime.current()  # once, when built: the step reaches the engine through the channel
        named = None if named_parameters is None else list(named_parameters)
        ordered = _ready_order(self.param_groups, named)
        explicit = _resolve_groups(groups, ordered)
        if not process_set.included():  # as in Horovod: a plain local optimizer on other ranks
            ordered, explicit = [], None
        elif op == Adasum:
            adasum.check_arguments(ordered, process_set.size(), "DistributedOptimizer")
        self._channel = current.channel(process_set) if ordered else None
        self._parameter_names = _parameter_names(self.param_groups, named)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.sparse_as_dense = sparse_as_dense
        self._scales = ((1.0 / gradient_predivide_factor, gradient_predivide_factor) if op == Average
                        else (1.0, 1.0))
        self.process_set = process_set
        self._overlap = bucketing.overlap
        if op == Adasum:  # the parameter changes exist only once step() has run
            self._overlap = False
        elif self._overlap is None:
            self._overlap = overlap_pays_here(ordered, current.topology.local.size)
        self._should_synchronize = True
        self._params = ordered
        slots = [Slot(p.numel(), p.element_size(), (p.dtype, p.device)) for p in ordered]
        plan = plan_buckets(slots, explicit,
                            first_bucket_bytes=bucketing.first_bucket_bytes, bucket_bytes=bucketing.bucket_bytes)
        prefix = current.names.instance("DistributedOptimizer", self.process_set.process_set_id) + ".bucket"
        # Views need the bucket to travel whole: not for Adasum (which reduces parameter changes)
        # nor for a compressor of the user's, which compresses each gradient on its own.
        views = op != Adasum and compressor(compression) in (Compression.none, Compression.fp16)
        averaging = Averaging(self._channel, op=op, scales=self._scales, compression=compression,
                              sparse_as_dense=sparse_as_dense, names=self._parameter_names)
        self._reducer = GradientReducer(
            ordered, [spec.members for spec in plan], averaging,
            names=[f"{prefix}.{number}" for number in range(len(plan))],
            param_names=[self._parameter_names.get(p, "?") for p in ordered],
            passes_per_step=backward_passes_per_step, overlap=self._overlap, views=views)
        self._buckets = self._reducer.buckets

    def synchronize(self) -> None:
        """Finish reducing the gradients accumulated since the last step: start the buckets
        backward did not complete (a parameter without a gradient contributes zeros, so every
        rank starts the same buckets) and wait for all of them.  Every rank of the process set
        must call it; calling it again before the next backward or step changes nothing.
        With ``op=hvd.Adasum`` there is nothing to do before ``step()``, as in Horovod."""
        if self._reducer.synchronized or self.op == Adasum:
            return
        self._reducer.synchronize()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Let ``step()`` use the gradients as they are, after an explicit ``synchronize()``
        (e.g. to clip the reduced gradients in between).  Not with ``op=hvd.Adasum``, whose
        step reduces parameter changes, not gradients (Horovod raises alike)."""
        if self.op == Adasum:
            raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self.op == Adasum:
            return self._adasum_step(closure)
        if self._should_synchronize:
            if self._reducer.synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(); the gradients are already reduced and are used as they "
                              "are. Use optimizer.skip_synchronize() around step() after synchronize().")
            self.synchronize()
        self._reducer.synchronized = False
        return super().step(closure)

    def _adasum_step(self, closure):
        """Horovod's Adasum optimizer: a local step of the wrapped optimizer, then every
        parameter moves from where it started by the Adasum of the ranks' changes (each
        bucket one grouped Adasum allreduce, each tensor its own coefficients) instead of by
        a step on averaged gradients."""
        starts = [param.detach().clone() for param in self._params]
        loss = super().step(closure)
        # The parameters hold their changes while these are reduced, in place.
        deltas = [param.detach().sub_(start) for param, start in zip(self._params, starts)]
        works = []
        for bucket in self._buckets:
            members = [deltas[index] for index in bucket.members]
            packed = [self._compression.compress(delta) for delta in members]
            wires = [wire for wire, _ in packed]
            call = allreduce_call(self._channel, wires, True, bucket.name, Adasum, None, 1.0, 1.0)
            works.append((members, packed, self._channel.start(allreduce_work(call, wires, True, True))))
        for members, packed, work in works:
            for delta, wire, (_, ctx) in zip(members, self._channel.wait(work), packed):
                reduced = self._compression.decompress(wire, ctx)
                if reduced is not delta:
                    delta.copy_(reduced)
        for delta, start in zip(deltas, starts):
            delta.add_(start)
        self._reducer.wait()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: set every gradient to None, or with ``set_to_none=False`` zero it in place,
        as a view of its bucket's buffer (each bucket then travels as one tensor, see
        :mod:`psrt.dp.reducer`).  Raises, as Horovod does, while allreduces of this step are
        outstanding."""
        if self._reducer.in_flight:
            raise AssertionError(_ZERO_GRAD_IN_FLIGHT)
        if set_to_none:
            super().zero_grad(set_to_none)
        else:
            self._reducer.zero_into_views()
            reduced = {id(p) for p in self._reducer.params}
            for group in self.param_groups:  # parameters not reduced here (a rank outside the set)
                for param in group["params"]:
                    if param.grad is not None and id(param) not in reduced:
                        param.grad.detach_().zero_()

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError("DistributedOptimizer cannot reduce the gradients of parameters added after wrapping; "
                         "add every parameter group to the optimizer before DistributedOptimizer(...)")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before the allreduce (Horovod's API)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")
        self.backward_passes_per_step = passes
        self._reducer.set_passes_per_step(passes)


def _parameter_names(param_groups, named: list | None) -> dict[torch.Tensor, str]:
    """Horovod's ``_parameter_names``: each parameter's name in ``named_parameters`` or, without
    them, ``allreduce.noname.<group>.<index>``; names order the mapping, as in Horovod."""
    if named is None:
        named = [(f"allreduce.noname.{i}.{j}", p) for i, group in enumerate(param_groups)
                 for j, p in enumerate(group["params"])]
    return {param: name for name, param in sorted(named, key=lambda item: item[0])}


def _ready_order(param_groups, named_parameters) -> list[torch.Tensor]:
    """The optimizer's trainable parameters in the order backward completes their gradients:
    the reverse of registration order (``named_parameters``' order when given)."""
    params = [p for group in param_groups for p in group["params"]]
    if named_parameters is not None:
        named = check_names(list(named_parameters), params)
        in_optimizer = {id(p) for p in params}
        params = list({id(p): p for _, p in named if id(p) in in_optimizer}.values())
    return [p for p in reversed(params) if p.requires_grad]


def _resolve_groups(groups, ordered: list[torch.Tensor]) -> list[list[int]] | None:
    """Horovod's ``groups`` as lists of ready-order positions: a number of equal runs, or the
    given lists (parameters not listed are reduced alone); None means buckets by size."""
    if groups is None:
        return None
    if isinstance(groups, int) and not isinstance(groups, bool) and groups > 0:
        return split_evenly(len(ordered), groups)
    if not isinstance(groups, list):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    position = {id(p): i for i, p in enumerate(ordered)}
    listed: set[int] = set()
    resolved = []
    for group in groups:
        members = []
        for p in _tensors_of(group):
            if id(p) in listed:
                raise ValueError("A parameter can only appear once in groups.")
            listed.add(id(p))
            if id(p) in position:
                members.append(position[id(p)])
        if members:
            resolved.append(members)
    resolved.extend([i] for i, p in enumerate(ordered) if id(p) not in listed)
    return resolved


def _tensors_of(group: object) -> list[torch.Tensor]:
    if not isinstance(group, (list, tuple)) or any(not isinstance(p, torch.Tensor) for p in group):
        raise ValueError("groups must consist of torch.Tensor.")
    return list(group)
