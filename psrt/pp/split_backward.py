"""A stage's backward in two halves, for zero-bubble schedules: the input gradient now
(the previous stage waits for it), the parameters' gradients later (nobody waits).

The input half runs autograd from the output to the stage's input only.  On the way it
passes the nodes where each parameter's gradient branches off that path (for a linear
layer, its matmul), and a pre-hook keeps the gradient arriving at each such node.  The
weight half restarts autograd from those nodes with the kept gradients and goes to the
parameters only, all of them in one call: a recomputed (checkpointed) region then runs its
forward again once for the weight half, as it does once for the input half.  In that call
every start node takes its kept gradient in place of whatever reaches it, and the rest of
the input's path carries nothing (its nodes get no gradient, so they skip their math), so
no activation gradient is computed twice and nothing is counted twice.  The weight half
accumulates into ``.grad`` through the parameters' own accumulation nodes, so
post-accumulate hooks (a data-parallel optimizer's) fire as in an ordinary backward.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightPass:
    """What the weight half of one micro-batch's backward needs: the nodes where the
    parameters' branches meet the input's path, the gradients kept there, the parameters,
    and the other nodes of the path."""

    starts: list[Node]
    params: list[torch.Tensor]
    path: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)

    def run(self) -> None:
        roots, grads = [], []
        for node in self.starts:
            for index, grad in enumerate(self.grads.get(node, ())):
                if grad is not None:
                    roots.append(GradientEdge(node, index))
                    grads.append(grad)
        if roots:
            hooks = [node.register_prehook(_feed(self.grads.get(node))) for node in self.starts]
            hooks += [node.register_prehook(_feed(None)) for node in self.path]
            try:
                torch.autograd.backward(roots, grads, inputs=self.params, retain_graph=True)
            finally:
                for handle in hooks:
                    handle.remove()
        self.starts, self.path, self.grads = [], [], {}


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
        return WeightPass([], [], [])
    on_path = _reachable(start, parents)
    starts, used = _starts(on_path, parents, [p for p in params if p.requires_grad])
    start_set = set(starts)
    weight_pass = WeightPass(starts, used, [node for node in on_path if node not in start_set])
    handles = [node.register_prehook(_keep(weight_pass, node)) for node in starts]
    try:
        (grad,) = torch.autograd.grad(output, input, grad_output, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    input.grad = grad if input.grad is None else input.grad + grad
    return weight_pass


def _keep(weight_pass: WeightPass, node: Node):
    def hook(grad_outputs: tuple) -> None:
        weight_pass.grads[node] = grad_outputs
    return hook


def _feed(kept: tuple | None):
    """A pre-hook giving a node ``kept`` (None: no gradient) instead of what reached it."""
    def hook(grad_outputs: tuple) -> tuple:
        return kept if kept is not None else (None,) * len(grad_outputs)
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


def _starts(on_path: set[Node], parents: dict[Node, list[Node]], params: list[torch.Tensor]
            ) -> tuple[list[Node], list[torch.Tensor]]:
    """The path nodes each parameter's branch meets first on its way up (every gradient of the
    parameter flows through one of them), and the parameters this micro-batch used."""
    starts: dict[Node, None] = {}
    used = []
    for param in params:
        leaf = get_gradient_edge(param).node
        if leaf not in parents:
            continue  # not used in this micro-batch's forward
        used.append(param)
        seen, queue = {leaf}, deque([leaf])
        while queue:
            for parent in parents[queue.popleft()]:
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in on_path:
                    starts[parent] = None
                else:
                    queue.append(parent)
    return list(starts), used
