"""Token trees for tree speculation (Medusa, EAGLE): choices, parents, depths, paths.

A draft tree has N nodes, numbered 0..N-1 in breadth-first order (a parent always comes before its
children). `parents[j]` is the parent node of node j, or -1 when node j hangs off the root. The root
is the last committed token: it is not a draft node, but the target runs it in the same forward.

The target forward over a tree has N + 1 rows: row 0 is the root, row j + 1 is node j. Each row
attends to the committed context, and inside the tree to itself and its ancestors only, at position
root position + depth (the engine passes the parents to `LlamaModel`, which builds that mask).

Static trees come from `medusa_choices` / `eagle_choices` (TensorRT-LLM's format): each choice is a
path of top-k ranks, e.g. (0, 1) = "the second-best token after the best first token".
"""

from __future__ import annotations

from dataclasses import dataclass

Choices = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class StaticTree:
    """A tree built from choices: one node per choice, breadth-first, then by rank."""

    choices: Choices  # node j's path of ranks, sorted by (depth, path)
    parents: tuple[int, ...]  # node j's parent node, -1 for depth-1 nodes

    @property
    def depths(self) -> list[int]:
        """Depth of every node (1 for children of the root)."""
        return [len(c) for c in self.choices]

    @property
    def ranks(self) -> list[int]:
        """Which top-k candidate of its parent's distribution each node takes."""
        return [c[-1] for c in self.choices]

    @property
    def max_depth(self) -> int:
        """Length of the longest path: how many tokens the tree can contribute at most."""
        return max(self.depths)


def tree_from_choices(choices) -> StaticTree:
    """Build a `StaticTree` from choice paths; raises ValueError naming a path whose prefix is missing."""
    ordered = tuple(sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c)))
    if not ordered or any(len(c) == 0 for c in ordered):
        raise ValueError("tree choices must be non-empty paths, e.g. [[0], [0, 0], [1]]")
    index = {c: j for j, c in enumerate(ordered)}
    parents = []
    for c in ordered:
        if len(c) > 1 and c[:-1] not in index:
            raise ValueError(f"tree choice {list(c)} has no parent path {list(c[:-1])}; add it to the choices")
        parents.append(index[c[:-1]] if len(c) > 1 else -1)
    return StaticTree(choices=ordered, parents=tuple(parents))


def node_depths(parents: list[int] | tuple[int, ...]) -> list[int]:
    """Depth of every node of a tree given by parent indices (children of the root have depth 1)."""
    depths: list[int] = []
    for j, parent in enumerate(parents):
        if parent >= j:
            raise ValueError(f"tree node {j} has parent {parent}: parents must come before their children")
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def chain_parents(num_tokens: int) -> list[int]:
    """Parents of a plain draft chain: node j hangs off node j - 1."""
    return list(range(-1, num_tokens - 1))


def path_to(parents: list[int] | tuple[int, ...], node: int) -> list[int]:
    """Node indices from the root's child down to `node` (empty for node -1, the root)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
