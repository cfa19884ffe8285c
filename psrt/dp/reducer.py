"""The gradient reducer under every data-parallel optimizer: backward hooks, readiness, buckets.

``hvd.DistributedOptimizer``, ``psrt.zero.ZeroOptimizer`` and ``psrt.ps.DistributedOptimizer``
do the same thing during backward: count, per parameter, the backward passes that finished
accumulating its gradient; once every member of a bucket is complete, start the bucket's
communication (during backward, where overlapping pays); at the end, start the buckets
backward did not complete -- a parameter without a gradient gets zeros, so every rank starts
the same buckets -- and wait for all of them.  They differ only in what a bucket's
communication is, a :class:`BucketStrategy`: average in place (DistributedOptimizer),
reduce-scatter into shards (ZeRO), push to the servers (parameter server).

With ``views``, each bucket owns one flat buffer that its members' ``.grad`` can be views of
(DDP's ``gradient_as_bucket_view``); a bucket whose dense gradients all are their views is
reduced as one contiguous tensor, in place: no fusion copy in and out.  Gradients become views
where that costs nothing: when the optimizer zeroes them in place (``zero_grad(set_to_none=False)``,
:meth:`GradientReducer.zero_into_views`), after which autograd accumulates into the views.
A gradient autograd made fresh (after ``zero_grad()``'s default ``set_to_none=True``) is not
copied in: copying it would cost a pass over every gradient each step, more than the engine
spends reducing large tensors where they lie and packing only the small ones, so such a
bucket is reduced as its members' gradients, as without views.  A parameter whose gradient
comes sparse keeps it (the strategy reduces it its own way).

Collective: every rank builds the same reducer (same parameters, buckets and names) and runs
the same backward passes and ``synchronize()`` calls, in the same order.
"""
from __future__ import annotations

import abc
import weakref
from collections import Counter
from typing import Iterable, Sequence

import torch

from psrt.comm.crowding import usable_cores
from psrt.dp.buckets import overlap_pays

#: Horovod's message for one backward pass too many (DistributedOptimizer keeps its wording).
TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")


class Bucket:
    """One bucket: its members' positions in the reducer's parameter list, their parameters, and
    this step's state.  ``awaited`` says the bucket was launched by ``synchronize()``, which
    waits for it right away (its communication need not wake the engine thread: the waiting
    thread runs it).  ``started`` belongs to the strategy (what its ``launch`` started, kept
    until ``finish``); ``buffer`` and ``views`` exist with views."""

    __slots__ = ("index", "name", "members", "params", "waiting", "launched", "awaited", "started", "buffer",
                 "views")

    def __init__(self, index: int, name: str, members: tuple[int, ...], params: list[torch.Tensor]) -> None:
        self.index, self.name, self.members, self.params = index, name, members, params
        self.buffer: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []  # each member's slot of ``buffer``
        self.reset()

    def reset(self) -> None:
        self.waiting = len(self.members)  # members whose gradient is not complete for this step
        self.launched = self.awaited = False
        self.started: object | None = None

    def grads(self) -> list[torch.Tensor]:
        """The members' gradients (complete and zero-filled once the bucket is launched)."""
        return [param.grad for param in self.params]


class BucketStrategy(abc.ABC):
    """What a bucket's communication is (an abstract base: each optimizer implements ``launch``
    and ``finish``).  ``launch`` starts it once every member's gradient is
    complete (``bucket.grads()``); ``finish`` waits for it and leaves the result where the
    optimizer expects it.  Called in the same order on every rank."""

    def ready(self, bucket: Bucket) -> None:
        """Every member's gradient is complete for this step (called during backward, whether
        or not the bucket is launched now)."""

    @abc.abstractmethod
    def launch(self, bucket: Bucket) -> None:
        """Start the bucket's communication."""

    @abc.abstractmethod
    def finish(self, bucket: Bucket) -> None:
        """Wait for it and leave the result where the optimizer expects it."""

    def all_finished(self) -> None:
        """Every bucket of the step is finished (the end of ``GradientReducer.synchronize``)."""

    def too_many_passes(self, name: str) -> BaseException:
        """The error for one backward pass more than the step takes (parameter ``name``)."""
        return AssertionError(TOO_MANY_PASSES)


class GradientReducer:
    """Counts gradients as backward completes them and has ``strategy`` reduce each bucket.

    :param params: the parameters, in the order backward completes their gradients.
    :param buckets: lists of positions in ``params``, each parameter in one; launched in this
        order by ``synchronize()``.
    :param names: the buckets' names (the same on every rank).
    :param param_names: each parameter's name, for errors.
    :param passes_per_step: backward passes accumulated before a bucket is complete.
    :param overlap: launch a bucket during backward as soon as it is complete; otherwise in
        ``synchronize()``.
    :param hooks: count backward passes (a post-accumulate hook per parameter); without hooks
        every bucket is launched by ``synchronize()``.
    :param every_backward: call ``synchronize()`` at the end of every backward (autograd's
        final callback) instead of leaving it to the optimizer's step.
    :param views: make every dense gradient a view of its bucket's flat buffer; the buckets'
        members must share dtype and device.
    """

    def __init__(self, params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]], strategy: BucketStrategy,
                 *, names: Sequence[str], param_names: Sequence[str], passes_per_step: int = 1, overlap: bool = True,
                 hooks: bool = True, every_backward: bool = False, views: bool = False) -> None:
        self.params, self.strategy, self.param_names = list(params), strategy, list(param_names)
        self.passes_per_step, self.overlap, self.every_backward = passes_per_step, overlap, every_backward
        self.buckets = [Bucket(i, name, tuple(members), [self.params[m] for m in members])
                        for i, (name, members) in enumerate(zip(names, buckets))]
        self._place = [(0, 0)] * len(self.params)  # per parameter: (its bucket, its slot there)
        for bucket in self.buckets:
            for slot, member in enumerate(bucket.members):
                self._place[member] = (bucket.index, slot)
        self._counts = [0] * len(self.params)
        self._end_queued = False
        self.synchronized = False  # nothing accumulated since the last synchronize()
        if views:
            for bucket in self.buckets:
                _give_buffer(bucket)
        if hooks:
            handles = [p.register_post_accumulate_grad_hook(_ready_hook(weakref.ref(self), i))
                       for i, p in enumerate(self.params)]
            weakref.finalize(self, _remove_hooks, handles)

    # -- during backward ------------------------------------------------------------------
    def gradient_ready(self, index: int) -> None:
        """Backward finished accumulating parameter ``index``'s gradient (its hook)."""
        self.synchronized = False
        if self.every_backward and not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        count = self._counts[index] + 1
        if count > self.passes_per_step:
            raise self.strategy.too_many_passes(self.param_names[index])
        self._counts[index] = count
        bucket = self.buckets[self._place[index][0]]
        if count == self.passes_per_step:
            bucket.waiting -= 1
            if bucket.waiting == 0:
                if self.overlap:
                    self._launch(bucket, awaited=False)
                self.strategy.ready(bucket)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self.synchronize()

    def _launch(self, bucket: Bucket, awaited: bool) -> None:
        bucket.launched, bucket.awaited = True, awaited
        self.strategy.launch(bucket)

    # -- at the step ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Launch every bucket not launched yet (a member without a gradient gets zeros), wait
        for all of them, and start counting the next step's passes."""
        for bucket in self.buckets:
            if not bucket.launched:
                _zero_fill(bucket)
                self._launch(bucket, awaited=True)
        self.wait()
        self.synchronized = True
        self.strategy.all_finished()

    def wait(self) -> None:
        """Finish the buckets launched so far, drop the rest's progress: the state a new step
        starts from (after ``synchronize()``, or after a backward that raised)."""
        try:
            for bucket in self.buckets:
                if bucket.launched:
                    self.strategy.finish(bucket)
        finally:
            for bucket in self.buckets:
                bucket.reset()
            self._counts = [0] * len(self.params)
            self._end_queued = False  # a backward that raised never ran its final callback

    def zero_into_views(self) -> None:
        """Zero the gradients in place, as views of their bucket buffers (for
        ``zero_grad(set_to_none=False)``): a dense gradient that is not its view yet becomes it,
        so that autograd accumulates into the buffer from the next backward on.  Without views, every gradient is zeroed where it is."""
        for bucket in self.buckets:
            for slot, param in enumerate(bucket.params):
                grad = param.grad
                if grad is None:
                    continue
                if bucket.buffer is None or grad.is_sparse:
                    grad.zero_()
                else:
                    param.grad = bucket.views[slot].zero_()

    @property
    def in_flight(self) -> bool:
        """Whether some bucket of this step is launched and not finished."""
        return any(bucket.launched for bucket in self.buckets)

    def set_passes_per_step(self, passes: int) -> None:
        self.passes_per_step = passes
        for bucket in self.buckets:
            bucket.reset()
        self._counts = [0] * len(self.params)


def _give_buffer(bucket: Bucket) -> None:
    first = bucket.params[0]
    bucket.buffer = torch.zeros(sum(p.numel() for p in bucket.params), dtype=first.dtype, device=first.device)
    views = bucket.buffer.split([p.numel() for p in bucket.params])
    bucket.views = [view.view(p.shape) for view, p in zip(views, bucket.params)]


def whole_buffer(bucket: Bucket) -> bool:
    """Whether the bucket can travel as its buffer: every dense gradient is its view (a sparse
    member's slot is zeroed, the strategy reduces that gradient its own way)."""
    if bucket.buffer is None:
        return False
    dense = [slot for slot, p in enumerate(bucket.params) if not p.grad.is_sparse]
    if any(bucket.params[slot].grad is not bucket.views[slot] for slot in dense):
        return False
    for slot in set(range(len(bucket.params))) - set(dense):
        bucket.views[slot].zero_()
    return True


def _zero_fill(bucket: Bucket) -> None:
    """Zeros for members without a gradient: their view, zeroed, with views."""
    for slot, param in enumerate(bucket.params):
        if param.grad is not None:
            continue
        if bucket.buffer is None:  # not zeros_like: a released ZeRO-3 parameter refuses to be read
            param.grad = torch.zeros(param.shape, dtype=param.dtype, device=param.device)
        else:
            param.grad = bucket.views[slot].zero_()


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _ready_hook(reducer_ref: weakref.ref, index: int):
    """A post-accumulate-grad hook that does nothing once its reducer is gone."""
    def hook(_param: torch.Tensor) -> None:
        reducer = reducer_ref()
        if reducer is not None:
            reducer.gradient_ready(index)
    return hook


def overlap_pays_here(params: Iterable[torch.Tensor], ranks_on_host: int) -> bool:
    """:func:`overlap_pays` for this process's cores and torch threads, with ``ranks_on_host``
    ranks on this host: the default of every optimizer that can overlap communication with
    backward."""
    return overlap_pays({p.device for p in params}, ranks_on_host, usable_cores(), torch.get_num_threads())


def check_names(named: list, params: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """Check Horovod's ``named_parameters``: ``(name, parameter)`` pairs with unique names that
    name every parameter of ``params``; returns them."""
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
