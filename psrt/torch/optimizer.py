"""``DistributedOptimizer``: Horovod's data-parallel optimizer wrapper, with DDP's gradient buckets.

Every rank computes gradients on its own batch; the wrapper averages them over
the process set before the wrapped optimizer's step.  Parameters are split
into buckets (planned by ``_buckets``, in the order backward completes their
gradients), and each bucket's allreduce starts during backward as soon as its
last gradient is accumulated, so communication overlaps the rest of backward.

Gradients are whatever autograd produces: ``.grad`` is assigned by autograd
and a bucket is one grouped allreduce of its parameters' ``.grad`` tensors,
reduced in place.  There are no persistent flat buffers behind the
gradients: keeping gradients as views of such buffers costs two extra memory
passes per step (zeroing the buffer, and autograd accumulating into an
existing ``.grad`` instead of just taking the fresh gradient tensor), which
is more than the engine spends on a grouped call, where it reduces large
tensors where they lie and copies (packs) only the small ones.

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
import os
import warnings
import weakref
from collections import Counter
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch

import psrt.torch as hvd
from psrt import runtime
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch import adasum
from psrt.torch._buckets import Bucketing, Slot, overlap_pays, plan_buckets, split_evenly
from psrt.torch.compression import Compression, compressor
from psrt.torch.ops import Adasum, Average, Sum

__all__ = ["Bucketing", "DistributedOptimizer"]

_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")
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
        ``psrt.torch._buckets.overlap_pays``).  Keyword only.
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


class _GradientBucket:
    """One bucket's parameters (ready-order positions) and the state of its reduction in this step."""

    __slots__ = ("name", "members", "waiting", "started", "handle", "grads", "ctxs", "targets", "sparse")

    def __init__(self, name: str, members: tuple[int, ...]) -> None:
        self.name, self.members = name, members
        self.reset()

    def reset(self) -> None:
        self.waiting = len(self.members)  # members whose gradient is not complete for this step
        self.started = False
        self.handle: int | None = None  # the grouped allreduce of the dense gradients, if any
        self.grads: list[torch.Tensor] = []  # the dense gradients submitted, which receive the result
        self.ctxs: list[object] = []  # compression contexts, one per dense gradient
        self.targets: list[torch.Tensor | None] = []  # per dense gradient: the sparse one it stands for
        self.sparse: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []  # allgathered gradients


class _DistributedOptimizer:
    """The methods a wrapped optimizer's class gets in front of its own (see DistributedOptimizer)."""

    def _setup_distributed(self, named_parameters, compression, backward_passes_per_step, op,
                           gradient_predivide_factor, groups, sparse_as_dense, process_set, bucketing) -> None:
        named = None if named_parameters is None else list(named_parameters)
        ordered = _ready_order(self.param_groups, named)
        explicit = _resolve_groups(groups, ordered)
        if not process_set.included():  # as in Horovod: a plain local optimizer on other ranks
            ordered, explicit = [], None
        elif op == Adasum:
            adasum.check_arguments(ordered, process_set.size(), "DistributedOptimizer")
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
            self._overlap = overlap_pays_here(ordered)
        self._synchronized = False
        self._should_synchronize = True
        self._params = ordered
        self._bucket_of: list[_GradientBucket] = [None] * len(ordered)  # type: ignore[list-item]
        self._buckets = self._build_buckets(explicit, bucketing)
        self._counts = [0] * len(ordered)
        hooks = [p.register_post_accumulate_grad_hook(_grad_ready_hook(weakref.ref(self), i))
                 for i, p in enumerate(ordered)]
        weakref.finalize(self, _remove_hooks, hooks)

    def _build_buckets(self, explicit, bucketing: Bucketing) -> list[_GradientBucket]:
        slots = [Slot(p.numel(), p.element_size(), (p.dtype, p.device)) for p in self._params]
        plan = plan_buckets(slots, explicit,
                            first_bucket_bytes=bucketing.first_bucket_bytes, bucket_bytes=bucketing.bucket_bytes)
        prefix = runtime.current().names.instance("DistributedOptimizer", self.process_set.process_set_id) + ".bucket"
        buckets = [_GradientBucket(f"{prefix}.{number}", spec.members) for number, spec in enumerate(plan)]
        for bucket in buckets:
            for index in bucket.members:
                self._bucket_of[index] = bucket
        return buckets

    def _on_grad_ready(self, index: int) -> None:
        """A backward pass finished accumulating parameter ``index``'s gradient."""
        self._synchronized = False
        self._counts[index] += 1
        if self._counts[index] > self.backward_passes_per_step:
            raise AssertionError(_TOO_MANY_PASSES)
        if self._counts[index] == self.backward_passes_per_step:
            bucket = self._bucket_of[index]
            bucket.waiting -= 1
            if bucket.waiting == 0 and self._overlap:
                self._submit(bucket)

    def _submit(self, bucket: _GradientBucket) -> None:
        """Start reducing the bucket's gradients: one grouped allreduce of the dense ones, in
        place, and an allgather of each sparse one (Horovod's ``sparse_allreduce_async``).

        A parameter without a gradient gets zeros (every rank then submits the same names and
        shapes); with ``sparse_as_dense`` a sparse gradient is reduced as a dense copy.
        """
        bucket.started = True
        for index in bucket.members:
            param = self._params[index]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grad = param.grad
            if not grad.is_sparse:
                bucket.grads.append(grad)
                bucket.targets.append(None)
            elif self.sparse_as_dense:
                bucket.grads.append(grad.to_dense())
                bucket.targets.append(grad)
            else:
                name = f"{bucket.name}.{self._parameter_names[param]}"
                bucket.sparse.append((grad, hvd.sparse_allreduce_async(grad, name=name, op=self.op,
                                                                       process_set=self.process_set)))
        if not bucket.grads:
            return
        packed = [self._compression.compress(grad) for grad in bucket.grads]
        bucket.ctxs = [ctx for _, ctx in packed]
        prescale, postscale = self._scales
        bucket.handle = hvd.grouped_allreduce_async_([wire for wire, _ in packed], name=bucket.name, op=self.op,
                                                     prescale_factor=prescale, postscale_factor=postscale,
                                                     process_set=self.process_set)

    def synchronize(self) -> None:
        """Finish reducing the gradients accumulated since the last step: start the buckets
        backward did not complete (a parameter without a gradient contributes zeros, so every
        rank starts the same buckets) and wait for all of them.  Every rank of the process set
        must call it; calling it again before the next backward or step changes nothing.
        With ``op=hvd.Adasum`` there is nothing to do before ``step()``, as in Horovod."""
        if self._synchronized or self.op == Adasum:
            return
        for bucket in self._buckets:
            if not bucket.started:
                self._submit(bucket)
        for bucket in self._buckets:
            outputs = hvd.synchronize(bucket.handle) if bucket.handle is not None else []
            for grad, target, wire, ctx in zip(bucket.grads, bucket.targets, outputs, bucket.ctxs):
                reduced = self._compression.decompress(wire, ctx)
                if target is not None:  # sparse_as_dense: given back sparse, as in Horovod
                    target.zero_().add_(reduced.to_sparse(target.sparse_dim()))
                elif reduced is not grad:
                    grad.copy_(reduced)
            for grad, handle in bucket.sparse:
                grad.zero_().add_(handle())
            bucket.reset()
        self._counts = [0] * len(self._params)
        self._synchronized = True

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
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(); the gradients are already reduced and are used as they "
                              "are. Use optimizer.skip_synchronize() around step() after synchronize().")
            self.synchronize()
        self._synchronized = False
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
        started = []
        for bucket in self._buckets:
            members = [deltas[index] for index in bucket.members]
            packed = [self._compression.compress(delta) for delta in members]
            started.append((members, packed, hvd.grouped_allreduce_async_(
                [wire for wire, _ in packed], name=bucket.name, op=Adasum, process_set=self.process_set)))
        for members, packed, handle in started:
            for delta, wire, (_, ctx) in zip(members, hvd.synchronize(handle), packed):
                reduced = self._compression.decompress(wire, ctx)
                if reduced is not delta:
                    delta.copy_(reduced)
        for delta, start in zip(deltas, starts):
            delta.add_(start)
        self._counts = [0] * len(self._params)
        for bucket in self._buckets:
            bucket.reset()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: set every gradient to None, or with ``set_to_none=False`` zero it in place.
        Raises, as Horovod does, while allreduces of this step are outstanding."""
        if any(bucket.started for bucket in self._buckets):
            raise AssertionError(_ZERO_GRAD_IN_FLIGHT)
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise ValueError("DistributedOptimizer cannot reduce the gradients of parameters added after wrapping; "
                         "add every parameter group to the optimizer before DistributedOptimizer(...)")

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated before the allreduce (Horovod's API)."""
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")
        self.backward_passes_per_step = passes
        self._counts = [0] * len(self._params)
        for bucket in self._buckets:
            bucket.waiting = len(bucket.members)


def overlap_pays_here(params: Iterable[torch.Tensor]) -> bool:
    """:func:`overlap_pays` for this process's ranks, cores and torch threads: the default
    of every optimizer that can overlap communication with backward."""
    return overlap_pays({p.device for p in params}, hvd.local_size(), _usable_cores(), torch.get_num_threads())


def _usable_cores() -> int:
    """CPU cores this process may run on (its affinity; all of them under ``--bind-to none``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _remove_hooks(hooks: list) -> None:
    for hook in hooks:
        hook.remove()


def _grad_ready_hook(optimizer_ref: weakref.ref, index: int):
    """A post-accumulate-grad hook that does nothing once its optimizer is gone."""
    def hook(_param: torch.Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None:
            optimizer._on_grad_ready(index)
    return hook


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
        named = _check_names(list(named_parameters), params)
        in_optimizer = {id(p) for p in params}
        params = list({id(p): p for _, p in named if id(p) in in_optimizer}.values())
    return [p for p in reversed(params) if p.requires_grad]


def _check_names(named: list, params: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    duplicates = sorted(name for name, times in Counter(name for name, _ in named).items() if times > 1)
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(map(str, duplicates))}")
    named_ids = {id(p) for _, p in named}
    unnamed = [f"#{i} (shape {tuple(p.shape)})" for i, p in enumerate(params) if id(p) not in named_ids]
    if unnamed:
        raise ValueError(f"named_parameters was specified, but one or more model parameters were not named: "
                         f"optimizer parameters {', '.join(unnamed)} (counted over param_groups)")
    return named


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
