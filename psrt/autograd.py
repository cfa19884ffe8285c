"""psrt's autograd functions pass no gradient on, and run nothing, when given none.

A zero-bubble pipeline's weight pass (:mod:`psrt.pp.split_backward`) sends no gradient along
the activations' path, so that no activation gradient is computed twice.  torch's own nodes
then skip their math, but a ``torch.autograd.Function`` is handed zeros unless it asks not to
be, and runs its whole backward on them: a tensor-parallel all-reduce, an expert all-to-all,
a context-parallel ring, for nothing.  Every rank of a group has the same graph, so all of
them skip alike.
"""
from __future__ import annotations

import functools

import torch

FunctionClass = type[torch.autograd.Function]


def skips_without_gradient(function: FunctionClass) -> FunctionClass:
    """Make a function of one output pass no gradient to any input, running nothing, when its
    backward is given none (a function of several outputs would be given None for those that
    get no gradient, where its backward expects zeros)."""
    forward, backward = function.forward, function.backward

    @functools.wraps(forward)
    def forward_without_zeros(ctx, *args, **kwargs):
        ctx.set_materialize_grads(False)
        return forward(ctx, *args, **kwargs)

    @functools.wraps(backward)
    def backward_if_given(ctx, grad):
        if grad is None:
            return (None,) * len(ctx.needs_input_grad)
        return backward(ctx, grad)

    function.forward, function.backward = staticmethod(forward_without_zeros), staticmethod(backward_if_given)
    return function
