"""Stage 3: gather each module's parameters just before it runs and free them right after.

A unit is a module that owns parameters directly, with the flat groups holding
them.  Forward: a pre-hook gathers the unit (and starts gathering the next
units in the order recorded during the first forward, up to the prefetch
budget); a post-hook frees it and hooks its outputs so that the gradient
arriving at them gathers the unit again, with the unit before it prefetched,
just before its own backward runs.  The optimizer frees a unit once its
gradients are reduced, and whatever is still gathered at the end of backward.

A parameter shared by two modules (tied input and output embeddings) belongs to
the unit of the first; every other module using it gathers that unit around its
own forward and again before its own backward, and frees it after its forward.
Its gradient, summed over the uses by autograd, is reduced once, when the last
use's backward is done.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from psrt.zero.flat import ShardedGroup


@dataclass
class Unit:
    module: torch.nn.Module
    groups: list[ShardedGroup]

    def numel(self) -> int:
        return sum(group.full.numel() for group in self.groups)


class ParameterGatherer:
    """Gathers and frees units around their forward and backward; records the peak of gathered
    parameter bytes, measured from the buffers' storages."""

    def __init__(self, units: list[Unit], prefetch_elements: int,
                 shared_uses: list[tuple[torch.nn.Module, int]] = ()) -> None:
        self.units, self.prefetch_elements = units, prefetch_elements
        self.order: list[int] = []          # forward order, recorded during the first forward
        self._recording = True
        self.peak_gathered_bytes = 0
        for index, unit in enumerate(units):
            unit.module.register_forward_pre_hook(lambda module, args, index=index: self._before_forward(index))
            unit.module.register_forward_hook(
                lambda module, args, output, index=index: self._after_forward(index, output))
        for module, index in shared_uses:  # another module's use of a unit's (tied) parameter
            module.register_forward_pre_hook(lambda module, args, index=index: self.gather(index))
            module.register_forward_hook(lambda module, args, output, index=index: self._after_use(index, output))

    def gather(self, index: int) -> None:
        for group in self.units[index].groups:
            group.start_gather()
        self._record_peak()
        for group in self.units[index].groups:
            group.finish_gather()

    def prefetch(self, indices: list[int]) -> None:
        for index in indices:
            for group in self.units[index].groups:
                group.start_gather()
        self._record_peak()

    def release(self, index: int) -> None:
        for group in self.units[index].groups:
            group.release()

    def release_all(self) -> None:
        for index in range(len(self.units)):
            self.release(index)

    def gathered_bytes(self) -> int:
        return sum(group.gathered_bytes() for unit in self.units for group in unit.groups)

    def _record_peak(self) -> None:
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def _next(self, index: int, step: int) -> list[int]:
        """Units after (step=1) or before (step=-1) ``index`` in forward order, up to the budget."""
        if index not in self.order:
            return []
        position, chosen, budget = self.order.index(index) + step, [], self.prefetch_elements
        while 0 <= position < len(self.order) and budget > 0:
            chosen.append(self.order[position])
            budget -= self.units[self.order[position]].numel()
            position += step
        return chosen

    def _before_forward(self, index: int) -> None:
        if self._recording and self.order and index == self.order[0]:
            self._recording = False  # a second forward started: the order is known
        if self._recording:
            self.order.append(index)
        self.gather(index)
        self.prefetch(self._next(index, 1))

    def _after_forward(self, index: int, output: object) -> None:
        self._after_use(index, output, self._before_backward)

    def _after_use(self, index: int, output: object, before_backward=None) -> None:
        """Free the unit, and gather it again when the gradient reaches this use's output."""
        self.release(index)
        if not torch.is_grad_enabled():
            return
        again = before_backward or self.gather
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        for tensor in tensors:
            tensor.register_hook(lambda grad, index=index: again(index))

    def _before_backward(self, index: int) -> None:
        self.gather(index)
        self.prefetch(self._next(index, -1))
