"""Split backward: gradients of a stage's inputs now, gradients of its weights later.

Zero-bubble schedules send the input gradients upstream as soon as possible (dI) and compute weight gradients
(dW) when the rank would otherwise idle. The input pass runs autograd towards the stage inputs only, so every
node computes just the gradients on that path: a matmul computes dX but not dW, and a custom autograd function
sees `ctx.needs_input_grad` False for its weight.

The weight pass must not walk the input path a second time. During the input pass, hooks capture the gradient
arriving at each *boundary node*: a node on the input path with an edge leaving it towards parameters (the
node of `x @ W` for a linear layer, whose other edge leads to x). The weight pass restarts autograd from each
boundary node with the captured gradient and asks for the parameters behind it only; one call per boundary
node, so a root never reaches another root's parameters through the input path. Parameters reachable from
outputs without touching the input path (a first stage, whose inputs are token ids, has only these) are
computed from the outputs directly.

A parameter used on the input path in two places where one lies below the other (weights tied within a
stage) would be counted twice that way; such parameters get their gradient in the input pass instead. So do
the parameters of a `torch.compile`d region: its backward is one node that computes every gradient whenever
it runs, so deferring them would run the region's backward twice; a compiled stage's weight pass keeps only
what lies outside its compiled regions (embedding, final norm, loss head), unless the blocks' projections are
kept out of the compiled graphs (`CompileConfig.defer_weight_grads`): their matmuls are then boundary nodes
like any eager one.

Gradients are summed per parameter and accumulated with one autograd call, so `.grad` accumulation hooks (the
gradient synchronizer's) fire exactly once per parameter and microbatch, as in a plain backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _WeightRoot:
    edges: list[GradientEdge]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]


@dataclass
class DeferredWeightGrad:
    """The weight pass of one (stage, microbatch); holds the autograd graph alive until `run`."""

    _roots: list[_WeightRoot] = field(default_factory=list)
    _keepalive: list[torch.Tensor] = field(default_factory=list)

    def run(self) -> None:
        totals: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for root in self._roots:
            grads = torch.autograd.grad(
                root.edges, root.params, root.grads, retain_graph=True, allow_unused=True
            )
            for param, grad in zip(root.params, grads, strict=True):
                if grad is None:
                    continue
                seen = totals.get(id(param))
                totals[id(param)] = (param, grad if seen is None else seen[1] + grad)
        self._roots.clear()
        self._keepalive.clear()
        if totals:
            params, grads = zip(*totals.values(), strict=True)
            torch.autograd.backward(list(params), list(grads))


def backward_input(
    outputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], DeferredWeightGrad]:
    """Gradients of `inputs` (leaf tensors), plus the deferred pass that accumulates `params`' `.grad`.

    Outputs without a gradient (None) or that do not require grad are skipped. Parameters that do not require
    grad are ignored (frozen).
    """
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if g is not None and o.requires_grad]
    roots = [o for o, _ in pairs]
    root_grads = [g for _, g in pairs]
    trainable = [p for p in params if p.requires_grad]
    wanted = [x for x in inputs if x.requires_grad]
    if not roots:
        return [None] * len(inputs), DeferredWeightGrad()
    graph = _Graph.build(roots, wanted, trainable)

    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [node.register_prehook(_capture_into(captured, node)) for node in graph.boundary]
    eager = [trainable[i] for i in graph.conflicting]
    try:
        if wanted or eager:
            for x in wanted:
                x.grad = None
            torch.autograd.backward(roots, root_grads, inputs=wanted + eager, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    input_grads = [x.grad if x.requires_grad else None for x in inputs]
    for x in wanted:
        x.grad = None

    deferred = DeferredWeightGrad(_keepalive=list(roots))
    for node, param_ids in graph.boundary.items():
        grads = captured.get(node)
        targets = [trainable[i] for i in param_ids if i not in graph.conflicting]
        if grads is None or not targets:
            continue
        edges = [GradientEdge(node, k) for k, g in enumerate(grads) if g is not None]
        if edges:
            deferred._roots.append(_WeightRoot(edges, [g for g in grads if g is not None], targets))
    direct = [(o, g) for (o, g), ids in zip(pairs, graph.direct_roots, strict=True) if ids]
    direct_ids = sorted({i for ids in graph.direct_roots for i in ids} - graph.conflicting)
    if direct and direct_ids:
        deferred._roots.append(
            _WeightRoot(
                [get_gradient_edge(o) for o, _ in direct],
                [g for _, g in direct],
                [trainable[i] for i in direct_ids],
            )
        )
    return input_grads, deferred


def _capture_into(
    captured: dict[Node, tuple[torch.Tensor | None, ...]], node: Node
) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        captured[node] = tuple(grad_outputs)

    return hook


@dataclass
class _Graph:
    boundary: dict[Node, list[int]]
    """Boundary node -> indices (into the trainable parameters) reachable through its off-path edges."""
    direct_roots: list[set[int]]
    """Per output: parameters reachable from it without touching the input path."""
    conflicting: set[int]
    """Parameters also reachable from below one of their boundary nodes: computed in the input pass."""

    @classmethod
    def build(
        cls, roots: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
    ) -> _Graph:
        input_nodes = {get_gradient_edge(x).node for x in inputs}
        param_bit = {get_gradient_edge(p).node: 1 << i for i, p in enumerate(params)}
        root_nodes = [get_gradient_edge(r).node for r in roots]
        on_path: dict[Node, bool] = {}
        below: dict[Node, int] = {}
        for node in _post_order(root_nodes):
            children = [child for child, _ in node.next_functions if child is not None]
            on_path[node] = node in input_nodes or any(on_path[c] for c in children)
            mask = param_bit.get(node, 0)
            for child in children:
                mask |= below[child]
            below[node] = mask
        boundary: dict[Node, list[int]] = {}
        conflicting = 0
        for node, path in on_path.items():
            if not path or node in input_nodes:
                continue
            children = [child for child, _ in node.next_functions if child is not None]
            off = 0
            deep = 0
            for child in children:
                if on_path[child]:
                    deep |= below[child]
                else:
                    off |= below[child]
            if off:
                boundary[node] = _bits(off)
                conflicting |= off & deep
                if _one_call(node):
                    conflicting |= off
        direct = [set() if on_path[n] else set(_bits(below[n])) for n in root_nodes]
        return cls(boundary, direct, set(_bits(conflicting)))


_ONE_CALL_NODES = frozenset({"CompiledFunctionBackward"})
"""Backward nodes that compute every gradient in one call whatever is asked (a `torch.compile`d region's
backward graph): restarting one in the weight pass would run the whole region's backward a second time, so
the parameters behind it get their gradients in the input pass."""

ONE_CALL_BACKWARD = "one_call_backward"
"""A custom `torch.autograd.Function` whose class sets this attribute to True is treated like a compiled
region: a second call of its backward would repeat work its first call (or its forward) already did, so its
parameters get their gradients in the input pass. The chunked loss head is one: its forward computes the
gradients of a summed loss while it holds each chunk's logits, and a weight pass of its own would recompute
every chunk's logits."""


def _one_call(node: Node) -> bool:
    if node.name() in _ONE_CALL_NODES:
        return True
    function = getattr(node, "_forward_cls", None)  # the Function class behind a custom function's node
    return function is not None and getattr(function, ONE_CALL_BACKWARD, False) is True


def _bits(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _post_order(roots: Sequence[Node]) -> list[Node]:
    """Every node reachable from `roots`, children before parents (iterative: graphs are deep)."""
    order: list[Node] = []
    seen: set[Node] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack: list[tuple[Node, int]] = [(root, 0)]
        while stack:
            node, i = stack.pop()
            children = node.next_functions
            while i < len(children) and (children[i][0] is None or children[i][0] in seen):
                i += 1
            if i < len(children):
                child = children[i][0]
                assert child is not None
                stack.append((node, i + 1))
                seen.add(child)
                stack.append((child, 0))
            else:
                order.append(node)
    return order
