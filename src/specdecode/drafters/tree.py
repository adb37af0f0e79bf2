"""Building draft trees: a trie of token paths under a node budget, and the static shape of a
tree chosen from how often each rank of a candidate list is the target's next token.

Both are shared by the drafters that propose trees (prompt lookup, recycling, a draft model).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from functools import lru_cache

import torch

from specdecode.drafters.base import Draft


class TreeBuilder:
    """A trie of draft tokens under the root (the sequence's last token), at most `budget`
    nodes. Nodes are numbered as they are added, so every parent comes before its children,
    and a node's children keep the order they were first added in: the first path added is
    the first path of the draft. A token added where its parent already has that child
    reuses the child (siblings are never duplicates)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self._children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.budget

    def child(self, parent: int, token: int) -> int | None:
        """The node for token under parent (-1: the root), added if new; None once the budget
        is spent and parent has no such child."""
        node = self._children.get((parent, token))
        if node is None and not self.full:
            node = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self._children[(parent, token)] = node
        return node

    def add_path(self, tokens: Iterable[int], parent: int = -1) -> int:
        """tokens as a path below parent, shared with the paths already there, as far as the
        budget goes; the last node of the path that fitted (parent if none did)."""
        for token in tokens:
            node = self.child(parent, token)
            if node is None:
                break
            parent = node
        return parent

    def draft(self) -> Draft:
        """The trie as a Draft: a chain (parents None) when every node has one child."""
        tokens = torch.tensor(self.tokens, dtype=torch.long)
        if self.parents == list(range(-1, len(self.parents) - 1)):
            return Draft(tokens, None)
        return Draft(tokens, None, parents=torch.tensor(self.parents, dtype=torch.long))


# the chance that the child of rank r (of a ranked candidate list, rank 0 the best) is the
# target's next token, by depth: acceptance[d - 1][r] at depth d, the last level for all deeper ones
Acceptance = tuple[tuple[float, ...], ...]


def at_depth(acceptance: Acceptance, depth: int) -> tuple[float, ...]:
    return acceptance[min(depth, len(acceptance)) - 1]


@lru_cache(maxsize=256)
def tree_shape(budget: int, acceptance: Acceptance) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The static tree of `budget` nodes that holds the most expected accepted tokens when the
    child of rank r at depth d is the target's next token with chance at_depth(acceptance, d)[r],
    independently of the other nodes: (parents, ranks), node i the rank ranks[i] child of node
    parents[i] (-1: the root).

    A node counts with the product of its path's acceptances (the chance it is reached), which
    shrinks down every path; so the best tree is the `budget` best nodes, taken best first, and
    this order is topological, keeps siblings in rank order (each level's chances decrease with
    the rank), and makes the shape for a smaller budget a prefix of this one's."""
    if not acceptance or not acceptance[0] or budget <= 0:
        return (), ()
    parents: list[int] = []
    ranks: list[int] = []
    chances: list[float] = []  # as path_chances computes them, so that both agree to the bit
    depths: list[int] = []
    # candidates: (-chance, order of creation, parent node, rank); the order breaks ties parent-first
    heap = [(-acceptance[0][0], 0, -1, 0)]
    created = 1
    while heap and len(parents) < budget:
        negative, _, parent, rank = heapq.heappop(heap)
        node = len(parents)
        depth = 1 if parent < 0 else depths[parent] + 1
        parents.append(parent)
        ranks.append(rank)
        chances.append(-negative)
        depths.append(depth)
        level, below = at_depth(acceptance, depth), at_depth(acceptance, depth + 1)
        followers = [(chances[node] * below[0], node, 0)]  # its own best child
        if rank + 1 < len(level):  # and its next sibling
            followers.append(((1.0 if parent < 0 else chances[parent]) * level[rank + 1], parent, rank + 1))
        for chance, p, r in followers:
            if chance > 0:
                heapq.heappush(heap, (-chance, created, p, r))
                created += 1
    return tuple(parents), tuple(ranks)


def path_chances(parents: Sequence[int], ranks: Sequence[int], acceptance: Acceptance) -> list[float]:
    """The chance each node of a shape is reached (the product of its path's acceptances)."""
    chances: list[float] = []
    depths: list[int] = []
    for parent, rank in zip(parents, ranks, strict=True):
        depths.append(1 if parent < 0 else depths[parent] + 1)
        chances.append((1.0 if parent < 0 else chances[parent]) * at_depth(acceptance, depths[-1])[rank])
    return chances


def chain_share(budget: int, chain_acceptance: float, acceptance: Acceptance) -> int:
    """How many of `budget` nodes a chain (a prompt-lookup continuation) whose every token is
    accepted with chance chain_acceptance should take, next to a ranked tree (tree_shape): the
    chain's node at depth d counts chain_acceptance ** d, and the budget goes to the best nodes
    of both."""
    parents, ranks = tree_shape(budget, acceptance)
    tree = path_chances(parents, ranks, acceptance)  # best first
    taken, in_tree, chain = 0, 0, chain_acceptance  # chain: the next chain node's chance
    while taken + in_tree < budget:  # merge the two lists, both best first; a tie goes to the chain
        if in_tree < len(tree) and tree[in_tree] > chain:
            in_tree += 1
        else:
            taken += 1
            chain *= chain_acceptance
    return taken
