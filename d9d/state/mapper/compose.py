"""Composition: `Sequential` (stages in order), `Graph` (order inferred from keys), `Parallel` (side by side).

A composition is itself a mapper. Its groups are found without data by following keys through the
children: two child groups that share an intermediate key end up in the same composed group, so a
composed group is the smallest unit that can run from source tensors to final tensors. Running it
pops each intermediate tensor as soon as the next step consumed it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from d9d.state.errors import StateMappingError
from d9d.state.mapper.base import StateGroup, StateMapper, TensorMap, apply_group, check_groups

Step = tuple[StateMapper, StateGroup]


class CompositeMapper(StateMapper):
    """A mapper whose groups each run a fixed list of child steps."""

    def __init__(self, plans: Mapping[StateGroup, Sequence[Step]]) -> None:
        self._groups = tuple(sorted(plans, key=StateGroup.sort_key))
        check_groups(type(self).__name__, self._groups)
        self._plans = {g: tuple(steps) for g, steps in plans.items()}

    def groups(self) -> Sequence[StateGroup]:
        return self._groups

    def apply(self, group: StateGroup, tensors: Mapping[str, torch.Tensor]) -> TensorMap:
        steps = self._plans.get(group)
        if steps is None:
            raise StateMappingError(f"{self!r} has no group {group!r}")
        env = dict(tensors)
        for mapper, step in steps:
            consumed = {k: env.pop(k) for k in step.inputs}
            env.update(apply_group(mapper, step, consumed))
        return env


class _UnionFind:
    def __init__(self) -> None:
        self.parent: list[int] = []

    def add(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, x: int) -> int:
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        self.parent[self.find(a)] = self.find(b)


def _chain(stages: Sequence[StateMapper]) -> dict[StateGroup, list[Step]]:
    """Plan stages run in order; keys a stage does not consume pass through it untouched.

    A stage's input comes from the latest stage that produced it and was not consumed since, else from
    the source (passing through the earlier stages). Refused, naming the key and stages: a key a
    previous stage consumed without producing again; a stage producing a key that passes through it.
    """
    uf = _UnionFind()
    steps: list[tuple[int, Step]] = []  # node id -> (stage, step)
    sources: dict[int, set[str]] = {}
    live: dict[str, int] = {}  # key -> producing node, not consumed yet
    consumed_at: dict[str, int] = {}  # key -> stage that consumed it (and nobody re-produced it)
    for s, stage in enumerate(stages):
        produced: dict[str, int] = {}
        for group in stage.groups():
            node = uf.add()
            steps.append((s, (stage, group)))
            sources[node] = set()
            for key in group.inputs:
                if key in live:
                    uf.union(node, live.pop(key))
                elif key in consumed_at:
                    raise StateMappingError(
                        f"stage {s} ({stage!r}) needs {key!r}, but stage {consumed_at[key]} "
                        f"({stages[consumed_at[key]]!r}) consumed it without producing it again"
                    )
                else:
                    sources[node].add(key)
                consumed_at[key] = s
            for key in group.outputs:
                produced[key] = node
        for key, node in produced.items():
            if key in live:
                prev = steps[live[key]][0]
                raise StateMappingError(
                    f"collision: stage {s} ({stages[s]!r}) produces {key!r}, but {key!r} from stage {prev} "
                    f"({stages[prev]!r}) passes through it untouched"
                )
            live[key] = node
            consumed_at.pop(key, None)

    members: dict[int, list[int]] = {}
    for node in range(len(steps)):
        members.setdefault(uf.find(node), []).append(node)
    outputs: dict[int, set[str]] = {}
    for key, node in live.items():
        outputs.setdefault(uf.find(node), set()).add(key)
    plans: dict[StateGroup, list[Step]] = {}
    for root, nodes in members.items():
        group = StateGroup.of(set().union(*(sources[n] for n in nodes)), outputs.get(root, set()))
        plans[group] = [steps[n][1] for n in sorted(nodes, key=lambda n: steps[n][0])]
    return plans


class Sequential(CompositeMapper):
    """Stages applied in order, outputs of one feeding the next: e.g. HF -> d9d layout, then distribute.

    Keys a stage does not mention pass through it, so a later stage may consume a source key directly
    or an earlier stage's output that the stages in between left alone.
    """

    def __init__(self, stages: Sequence[StateMapper]) -> None:
        if not stages:
            raise StateMappingError("Sequential needs at least one stage")
        self.stages = tuple(stages)
        super().__init__(_chain(self.stages))

    def inverse(self) -> StateMapper:
        return Sequential([m.inverse() for m in reversed(self.stages)])

    def __repr__(self) -> str:
        return f"Sequential({', '.join(map(repr, self.stages))})"


class Parallel(CompositeMapper):
    """Children over disjoint keys, side by side; a key shared by two children is a collision."""

    def __init__(self, children: Sequence[StateMapper]) -> None:
        self.children = tuple(children)
        seen_in: dict[str, int] = {}
        seen_out: dict[str, int] = {}
        for i, child in enumerate(self.children):
            for seen, keys, what in (
                (seen_in, child.inputs(), "consume"),
                (seen_out, child.outputs(), "produce"),
            ):
                for key in keys:
                    if key in seen:
                        j = seen[key]
                        raise StateMappingError(
                            f"collision: Parallel children {j} ({self.children[j]!r}) and {i} ({child!r}) "
                            f"both {what} {key!r}"
                        )
                    seen[key] = i
        super().__init__({g: [(child, g)] for child in self.children for g in child.groups()})

    def inverse(self) -> StateMapper:
        return Parallel([m.inverse() for m in self.children])

    def __repr__(self) -> str:
        return f"Parallel({len(self.children)} children, {len(self.groups())} groups)"


class Graph(CompositeMapper):
    """Mappers wired by key names into a DAG, order inferred: a node's outputs feed whichever node
    consumes them; keys no node produces are source keys, keys no node consumes are final outputs.

    Refused, naming keys and nodes: two nodes producing or consuming one key, and cycles.
    """

    def __init__(self, nodes: Sequence[StateMapper]) -> None:
        self.nodes = tuple(nodes)
        producer: dict[str, int] = {}
        consumer: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for table, keys, what in (
                (producer, node.outputs(), "produce"),
                (consumer, node.inputs(), "consume"),
            ):
                for key in keys:
                    if key in table:
                        j = table[key]
                        raise StateMappingError(
                            f"collision: Graph nodes {j} ({self.nodes[j]!r}) and {i} ({node!r}) "
                            f"both {what} {key!r}"
                        )
                    table[key] = i
        edges: dict[int, dict[int, str]] = {i: {} for i in range(len(self.nodes))}
        for key, i in consumer.items():
            if key in producer:
                edges[producer[key]][i] = key
        order = _topological(self.nodes, edges)
        super().__init__(_chain([self.nodes[i] for i in order]))

    def inverse(self) -> StateMapper:
        return Graph([m.inverse() for m in self.nodes])

    def __repr__(self) -> str:
        return f"Graph({len(self.nodes)} nodes, {len(self.groups())} groups)"


def _topological(nodes: Sequence[StateMapper], edges: Mapping[int, Mapping[int, str]]) -> list[int]:
    indegree = dict.fromkeys(range(len(nodes)), 0)
    for succ in edges.values():
        for j in succ:
            indegree[j] += 1
    ready = [i for i, d in indegree.items() if d == 0]
    order: list[int] = []
    while ready:
        i = ready.pop(0)
        order.append(i)
        for j in edges[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                ready.append(j)
    if len(order) == len(nodes):
        return order
    # Walk successors inside the leftover set until a node repeats: that walk is a cycle to report.
    left = {i for i, d in indegree.items() if d > 0}
    path = [min(left)]
    while True:
        nxt = next(j for j in edges[path[-1]] if j in left)
        if nxt in path:
            cycle = [*path[path.index(nxt) :], nxt]
            hops = " ".join(f"{a} ({nodes[a]!r}) --{edges[a][b]!r}-->" for a, b in itertools.pairwise(cycle))
            raise StateMappingError(f"cycle in Graph: {hops} {cycle[-1]}")
        path.append(nxt)
