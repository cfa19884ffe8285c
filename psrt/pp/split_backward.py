"""A stage's backward in two halves, for zero-bubble schedules: the input gradient now
(the previous stage waits for it), the parameters' gradients later (nobody waits).

The input half runs autograd from the output to the stage's input only.  On the way it
passes the nodes where each parameter's gradient branches off that path (for a linear
layer, its matmul), and a pre-hook keeps the gradient arriving at each such node.  The
weight half restarts autograd from those nodes with the kept gradients and goes to the
parameters only, so no activation gradient is computed twice.  Parameters whose
branches meet the path at the same nodes are done in one pass; where a pass starts
from several nodes and one lies below another, the lower one's kept gradient replaces
what flows into it, so nothing is counted twice.  The weight half accumulates into
``.grad`` through the parameters' own accumulation nodes, so post-accumulate hooks (a
data-parallel optimizer's) fire as in an ordinary backward.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Pass:
    """One weight pass: the nodes it starts from, their kept output gradients, its parameters."""

    nodes: list[Node]
    params: list[torch.Tensor]
    grads: dict[Node, tuple] = field(default_factory=dict)


@dataclass
class WeightPass:
    """What the weight half of one micro-batch's backward needs."""

    passes: list[_Pass]

    def run(self) -> None:
        for one in self.passes:
            _run(one)
        self.passes = []


def backward_input(output: torch.Tensor, grad_output: torch.Tensor | None, input: torch.Tensor,
                   params: list[torch.Tensor]) -> WeightPass:
    """Set ``input.grad`` to the gradient of ``output`` (weighted by ``grad_output``; None for a
    scalar loss) and return the weight half.  Where the input needs no gradient (the first
    stage) or does not reach the output, this is the whole backward and the weight half is empty."""
    root = output.grad_fn
    start = get_gradient_edge(input).node if input.requires_grad else None
    parents = _parents(root) if root is not None else {}
    if start is None or start not in parents:
        torch.autograd.backward(output, grad_output)
        return WeightPass([])
    on_path = _reachable(start, parents)
    passes = _passes(on_path, parents, [p for p in params if p.requires_grad])
    handles = [node.register_prehook(_keep(one, node)) for one in passes for node in one.nodes]
    try:
        (grad,) = torch.autograd.grad(output, input, grad_output, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    input.grad = grad if input.grad is None else input.grad + grad
    return WeightPass(passes)


def _keep(one: _Pass, node: Node):
    def hook(grad_outputs: tuple) -> None:
        one.grads[node] = grad_outputs
    return hook


def _parents(root: Node) -> dict[Node, list[Node]]:
    """For every node below ``root``, the nodes that pass gradients into it (towards the output)."""
    parents: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _reachable(start: Node, parents: dict[Node, list[Node]]) -> set[Node]:
    """``start`` and every node on a path from it up to the output."""
    seen, queue = {start}, deque([start])
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen


def _passes(on_path: set[Node], parents: dict[Node, list[Node]], params: list[torch.Tensor]) -> list[_Pass]:
    """Group the parameters by the path nodes their branches meet (shared nodes, one pass)."""
    passes: list[_Pass] = []
    pass_of: dict[Node, _Pass] = {}
    for param in params:
        leaf = get_gradient_edge(param).node
        if leaf not in parents:
            continue  # not used in this micro-batch's forward
        meets: list[Node] = []
        seen, queue = {leaf}, deque([leaf])
        while queue:
            for parent in parents[queue.popleft()]:
                if parent in seen:
                    continue
                seen.add(parent)
                (meets.append if parent in on_path else queue.append)(parent)
        merged = {id(pass_of[n]): pass_of[n] for n in meets if n in pass_of}
        one = _Pass(list(dict.fromkeys(meets)), [param])
        for other in merged.values():
            one.nodes = list(dict.fromkeys(other.nodes + one.nodes))
            one.params = other.params + one.params
            passes.remove(other)
        passes.append(one)
        for node in one.nodes:
            pass_of[node] = one
    return passes


def _run(one: _Pass) -> None:
    roots, grads = [], []
    for node in one.nodes:
        for index, grad in enumerate(one.grads.get(node, ())):
            if grad is not None:
                roots.append(GradientEdge(node, index))
                grads.append(grad)
    if not roots:
        return
    clamps = []
    if len(one.nodes) > 1:  # a start node below another takes its kept gradient, not the sum
        clamps = [node.register_prehook(lambda _, kept=one.grads.get(node): kept) for node in one.nodes]
    try:
        torch.autograd.backward(roots, grads, inputs=one.params, retain_graph=True)
    finally:
        for handle in clamps:
            handle.remove()
