"""Medusa's static sparse trees: which top-k choices of which heads are verified, as candidate index arrays.

A tree is a list of nodes, each an index path: element i of a path is the rank (0 = top-1) of the token taken
from Medusa head i, so (0,) is head 0's top token, (0, 1) head 1's second token under it, and so on. Every
node's parent (the path without its last element) must be in the tree, so a tree is closed under prefixes;
Medusa lists the nodes in the order its greedy construction added them (highest estimated acceptance first),
so every prefix of such a list is itself a tree. The runtime verifies a tree as its root-to-leaf paths
(candidates padded with PAD, see tree.py): packing them rebuilds exactly this tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mlx_redrafter.errors import UserError

TreePath = tuple[int, ...]

# Medusa's default tree ("mc_sim_7b_63", FasterDecoding/Medusa medusa_choices.py): 63 nodes over 4 heads, top-10
# per head, found for Vicuna-7B with estimated per-rank head accuracies. Re-typed as data from its definition.
MC_SIM_7B_63: tuple[TreePath, ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1),
    (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0),
    (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0),
    (0, 0, 0, 1), (1, 6), (0, 7, 0),
)

# The tree for a 2-core CPU: the first 7 nodes of MC_SIM_7B_63, i.e. Medusa's own greedy construction stopped at
# 7 drafted nodes + g0 = 8 verified tokens. The verify cost curve measured on this CPU (N=4 1.72x one token, N=8 2.17x,
# N=12 2.68x, N=16 2.76x) makes every node past the first three cost ~0.11-0.13x of a step up to N=12; a node
# pays only while its acceptance probability exceeds (tokens per step) x (marginal cost / step cost), ~0.1 here,
# which Medusa's ranking puts at about its 7th node for a well-trained head (head 0 top-1 ~0.6, top-2/3 ~0.1).
# Shape: (0,) (1,) (2,) | (0,0) (0,1) (1,0) | (0,0,0): top-3 of head 0, three children, the top-1 chain to depth 3.
CPU_TREE: tuple[TreePath, ...] = MC_SIM_7B_63[:7]

TREES: dict[str, tuple[TreePath, ...]] = {"cpu": CPU_TREE, "mc_sim_7b_63": MC_SIM_7B_63}
DEFAULT_TREE = "cpu"


def check_tree(paths: list[TreePath] | tuple[TreePath, ...]) -> tuple[TreePath, ...]:
    """The tree as a tuple of int tuples; one-line error unless it is non-empty, duplicate-free, has no negative
    ranks and holds every node's parent."""
    tree = tuple(tuple(int(i) for i in p) for p in paths)
    if not tree:
        raise UserError("a Medusa tree needs at least one node")
    seen: set[TreePath] = set()
    for p in tree:
        if not p or min(p) < 0:
            raise UserError(f"Medusa tree node {p!r}: a node is a non-empty path of top-k ranks (>= 0)")
        if p in seen:
            raise UserError(f"Medusa tree node {p!r} appears twice")
        seen.add(p)
    for p in tree:
        if len(p) > 1 and p[:-1] not in seen:
            raise UserError(f"Medusa tree node {p!r} has no parent {p[:-1]!r} in the tree")
    return tree


def parse_tree(spec: str) -> tuple[TreePath, ...]:
    """A tree by name ('cpu', 'mc_sim_7b_63') or 'NAME:N' (its first N nodes); one-line error otherwise."""
    name, _, count = spec.partition(":")
    if name not in TREES:
        raise UserError(f"unknown Medusa tree {spec!r}: choose {', '.join(TREES)} (or NAME:N for its first N nodes)")
    tree = TREES[name]
    if count:
        if not count.isdigit() or not 1 <= int(count) <= len(tree):
            raise UserError(f"Medusa tree {spec!r}: N must be an integer in 1..{len(tree)}")
        tree = tree[: int(count)]
    return check_tree(tree)


def candidate_paths(tree: tuple[TreePath, ...], max_depth: int, max_paths: int | None = None) -> list[TreePath]:
    """Root-to-leaf paths of the tree cut at `max_depth` heads, leaves in the order the tree lists them; at most
    `max_paths` of them (None: all)."""
    nodes = [p for p in tree if len(p) <= max_depth]
    inner = {p[:k] for p in nodes for k in range(1, len(p))}
    leaves = [p for p in nodes if p not in inner]
    return leaves if max_paths is None else leaves[:max_paths]


@dataclass(frozen=True)
class TreeIndex:
    """Where each candidate slot's token comes from: slot (c, i) (draft i+1 of candidate c) holds the token of
    rank `ranks[c, i]` from head `heads[c, i]`, where `valid[c, i]`; PAD elsewhere."""

    heads: np.ndarray  # (n, D) int32
    ranks: np.ndarray  # (n, D) int32
    valid: np.ndarray  # (n, D) bool
    top: int  # top-k needed per head: max rank + 1


def tree_index(tree: tuple[TreePath, ...], max_depth: int, width: int, max_paths: int | None = None) -> TreeIndex:
    """Index arrays of the candidates `candidate_paths(tree, max_depth, max_paths)`, `width` draft slots each
    (width >= max_depth; slots past a path's end are invalid)."""
    paths = candidate_paths(tree, max_depth, max_paths)
    n = len(paths)
    heads = np.zeros((n, width), dtype=np.int32)
    ranks = np.zeros((n, width), dtype=np.int32)
    valid = np.zeros((n, width), dtype=bool)
    for c, p in enumerate(paths):
        heads[c, : len(p)] = np.arange(len(p))
        ranks[c, : len(p)] = p
        valid[c, : len(p)] = True
    return TreeIndex(heads=heads, ranks=ranks, valid=valid, top=int(ranks.max()) + 1 if n else 1)
