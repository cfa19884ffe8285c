"""Stage 3: gather each unit's parameters just before it runs and free them right after.

A unit is a module with the flat groups holding its parameters (which modules are units:
:mod:`psrt.zero.units`; by default the model's repeated blocks and a root unit around the
whole model).  Forward: a pre-hook gathers the unit (and starts gathering the units after
it, up to the prefetch budget, once the order is known); a post-hook frees it and hooks its
output, so that the gradient arriving there gathers the unit again, with the units before
it prefetched, just before its own backward runs.  The optimizer frees a unit's group once
its gradients are reduced, and whatever is still gathered at the end of backward.

The order is recorded during the first forward, which ends when backward starts or the
first unit's forward starts again: the order in which units' forwards start (the next
units to prefetch in forward) and the order in which they end, whose reverse is backward's
(a root unit's forward ends after its blocks', and its backward starts first).  From then on
each unit's prefetch lists are fixed: nothing is searched per call.  The module hooks are
registered once; what each forward adds is one hook on the unit's output tensor(s), the
tensors that forward made.

A parameter shared by two units (tied input and output embeddings in two blocks) belongs to
the first; every other module using it gathers that unit around its own forward and again
before its own backward, and frees it after its forward.  Its gradient, summed over the
uses by autograd, is reduced once, when the last use's backward is done.

Gathered bytes are counted as groups gather and release (:class:`GatheredBytes`), so the
peak costs nothing per hook.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from psrt.comm import streams
from psrt.zero.flat import GatheredBytes, ShardedGroup


@dataclass
class Unit:
    module: torch.nn.Module
    groups: list[ShardedGroup]
    elements: int = field(init=False)

    def __post_init__(self) -> None:
        self.elements = sum(group.full.numel() for group in self.groups)

    def numel(self) -> int:
        return self.elements


class ParameterGatherer:
    """Gathers and frees units around their forward and backward; ``meter`` counts the bytes
    gathered now and at the peak (the groups' own meter)."""

    def __init__(self, units: list[Unit], prefetch_elements: int,
                 shared_uses: list[tuple[torch.nn.Module, int]] = (), meter: GatheredBytes | None = None) -> None:
        self.units, self.prefetch_elements = units, prefetch_elements
        self.meter = meter if meter is not None else GatheredBytes()
        first = next((group for unit in units for group in unit.groups), None)
        self._on_device = first is not None and streams.api().covers(first.full.device)  # a GPU's memory
        self.order: list[int] = []          # units by the start of their first forward
        self.finish_order: list[int] = []   # units by the end of their first forward
        self._recording = True
        self._ahead: list[list[int]] = [[] for _ in units]   # per unit: prefetched before its forward
        self._behind: list[list[int]] = [[] for _ in units]  # per unit: prefetched before its backward
        self._again = [functools.partial(self._before_backward, index) for index in range(len(units))]
        self._use_again = [functools.partial(self._gather_for_use, index) for index in range(len(units))]
        for index, unit in enumerate(units):
            unit.module.register_forward_pre_hook(functools.partial(self._before_forward, index))
            unit.module.register_forward_hook(functools.partial(self._after_forward, index))
        for module, index in shared_uses:  # another module's use of a unit's (tied) parameter
            module.register_forward_pre_hook(functools.partial(self._before_use, index))
            module.register_forward_hook(functools.partial(self._after_use, index))

    @property
    def peak_gathered_bytes(self) -> int:
        return self.meter.peak

    def gathered_bytes(self) -> int:
        return self.meter.now

    def gather(self, index: int, prefetching: list[int] = ()) -> None:
        """Gather unit ``index`` for use and start ``prefetching``'s gathers.  On a GPU they start
        before the wait for this unit, which then negotiates them in the same round, so they are
        queued on the all-gather stream before this unit's compute.  On the host they start after
        it: a thread that waits runs the round's gathers itself, and the prefetches are left to
        the engine thread while this unit computes."""
        groups = self.units[index].groups
        for group in groups:
            group.start_gather()
        early = bool(prefetching) and self._on_device
        if early:
            self.prefetch(prefetching)
        for group in groups:
            group.finish_gather()
        if prefetching and not early:
            self.prefetch(prefetching)

    def prefetch(self, indices: list[int]) -> None:
        for index in indices:
            for group in self.units[index].groups:
                group.start_gather()

    def release(self, index: int) -> None:
        for group in self.units[index].groups:
            group.release()

    def release_all(self) -> None:
        for unit in self.units:
            for group in unit.groups:
                group.release()

    def prefetch_lists(self) -> tuple[list[list[int]], list[list[int]]]:
        """Per unit, the units prefetched before its forward and before its backward (empty
        until the first forward has ended)."""
        return [list(units) for units in self._ahead], [list(units) for units in self._behind]

    # -- the order --------------------------------------------------------------------------
    def _stop_recording(self) -> None:
        """The first forward is over: fix each unit's prefetch lists, up to the budget."""
        self._recording = False
        backward = self.finish_order[::-1]
        for index in range(len(self.units)):
            self._ahead[index] = self._within_budget(self.order, index)
            self._behind[index] = self._within_budget(backward, index)

    def _within_budget(self, order: list[int], index: int) -> list[int]:
        """The units after ``index`` in ``order``, until the budget is spent (at least one)."""
        if index not in order:
            return []
        chosen, budget = [], self.prefetch_elements
        for other in order[order.index(index) + 1:]:
            if budget <= 0:
                break
            chosen.append(other)
            budget -= self.units[other].elements
        return chosen

    # -- hooks --------------------------------------------------------------------------------
    def _before_forward(self, index: int, module, args) -> None:
        if self._recording:
            if self.order and index == self.order[0]:
                self._stop_recording()  # a second forward started: the order is known
            elif index not in self.order:
                self.order.append(index)
        self.gather(index, self._ahead[index])

    def _after_forward(self, index: int, module, args, output) -> None:
        if self._recording and index not in self.finish_order:
            self.finish_order.append(index)
        self._free_until_backward(index, output, self._again[index])

    def _before_use(self, index: int, module, args) -> None:
        self.gather(index)

    def _after_use(self, index: int, module, args, output) -> None:
        self._free_until_backward(index, output, self._use_again[index])

    def _free_until_backward(self, index: int, output: object, again) -> None:
        """Free the unit, and gather it again (``again``) when the gradient reaches ``output``."""
        self.release(index)
        if not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):
            if output.requires_grad:
                output.register_hook(again)
            return
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(again)

    def _before_backward(self, index: int, grad: torch.Tensor | None = None) -> None:
        if self._recording:
            self._stop_recording()
        self.gather(index, self._behind[index])

    def _gather_for_use(self, index: int, grad: torch.Tensor | None = None) -> None:
        self.gather(index)
