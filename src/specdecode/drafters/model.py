"""A separate, smaller language model with the target's tokenizer drafts autoregressively.

Greedy decoding, for a target that verifies trees, drafts a tree as EAGLE-2 does (Li et al.
2024): level by level, the frontier's nodes most likely reached (the product of the draft's
probabilities along their path) offer their most probable children, and the draft is the k
offered nodes most likely reached. Its children are a deterministic function of the context,
so the tree is one-hot. Sampling drafts chains, each token drawn from its q.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from specdecode.core.sampling import SamplingParams, logits_to_probs, sample
from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.identity import runner_fingerprint
from specdecode.drafters.tree import TreeBuilder
from specdecode.runners import CachedSequence, ModelRunner

TREE_BRANCHING = 4  # children offered per expanded node, and nodes expanded per level


class ModelDrafter(Drafter):
    name = "model"
    per_sequence = False  # one draft model cache, shared: batches of one sequence
    depends_on_history = False
    drafts_trees = False

    def __init__(
        self,
        runner: ModelRunner,
        min_confidence: float = 0.0,
        name: str | None = None,
        tree: bool = False,
        branching: int = TREE_BRANCHING,
    ):
        """min_confidence: stop drafting after a token whose untempered draft probability is below
        it (a chain); tree: draft trees under greedy decoding, each expanded node offering its
        `branching` most probable children, and expanding `branching` nodes per level."""
        self.runner = runner
        self.min_confidence = min_confidence
        self.name = name or self.name
        self.drafts_trees = tree
        self.branching = branching
        self._cached = CachedSequence(runner)

    def begin(self, prompt_ids: list[int]) -> None:
        self._cached = CachedSequence(self.runner)
        # the draft's prefill, here rather than in the first propose(): timed as drafting, it
        # made the first draft of every request look several times dearer than the next ones,
        # and adaptive k switched off a draft model that paid (benchmarks/results/earlier-measurements.md)
        if 1 < len(prompt_ids) <= self.runner.max_length:
            self._cached.logits(prompt_ids[:-1])

    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        if self.drafts_trees and params.greedy:
            return self._tree(token_ids, min(k, self.runner.max_length - len(token_ids)))
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        # the draft's own context may be shorter than the target's: it stops proposing there
        for _ in range(min(k, self.runner.max_length - len(token_ids))):
            # the cache keeps everything but the newest token, so each call runs one position
            logits = self._cached.logits(token_ids + tokens)[-1]  # [vocab]
            q = logits_to_probs(logits, params)  # [vocab]
            tokens.append(int(sample(q, generator)))
            probs.append(q)
            # the draft's own confidence depends only on the draft prefix: stopping keeps exactness
            if self.min_confidence > 0 and float(torch.softmax(logits, -1).max()) < self.min_confidence:
                break
        if not tokens:
            return Draft.empty()
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.stack(probs))

    def _tree(self, token_ids: list[int], k: int) -> Draft:
        """Up to k nodes, EAGLE-2's expansion (module docstring), one draft forward per expanded node."""
        if k <= 0:
            return Draft.empty()
        offered: list[_Node] = []  # every child offered, in the order offered
        frontier = self._offer(token_ids, None, offered)
        for _ in range(k - 1):  # no node deeper than k can be among the k most likely
            # a node less likely than the k-th offered cannot enter the draft, nor can its children
            cutoff = heapq.nlargest(k, offered)[-1] if len(offered) >= k else None
            expand = [n for n in heapq.nlargest(self.branching, frontier) if cutoff is None or n > cutoff]
            frontier = [child for node in expand for child in self._offer(token_ids, node, offered)]
            if not frontier:
                break
        chosen = sorted(heapq.nlargest(k, offered), reverse=True)  # most likely first: parents before children
        builder, placed = TreeBuilder(k), {}
        for node in chosen:
            placed[node.order] = builder.child(-1 if node.parent is None else placed[node.parent.order], node.token)
        return builder.draft()

    def _offer(self, token_ids: list[int], node: _Node | None, offered: list[_Node]) -> list[_Node]:
        """The `branching` most probable children of node (None: the root), offered."""
        logits = self._cached.logits(token_ids + (node.path() if node is not None else []))[-1]  # [vocab]
        probs = torch.softmax(logits.float(), -1)  # [vocab]
        top = probs.topk(min(self.branching, probs.shape[0]))
        chance = 1.0 if node is None else node.chance
        children = [
            _Node(chance * p, len(offered) + i, t, node)
            for i, (p, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()))
        ]
        offered.extend(children)
        return children

    def finish(self, token_ids: list[int]) -> None:
        pass

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass  # the cache rolls itself back on the next proposal

    def learn(self, token_ids: list[int], draft: Draft, logits: torch.Tensor) -> None:
        pass

    def cache_identity(self) -> list | None:
        fingerprint = runner_fingerprint(self.runner)
        return None if fingerprint is None else [self.min_confidence, fingerprint]

    def fork(self) -> ModelDrafter:
        raise TypeError(f"the {self.name} drafter holds one draft-model cache; it cannot be forked")


@dataclass(frozen=True, eq=False)
class _Node:
    """An offered child. A node is "larger" when more likely reached, or as likely and offered
    earlier (a parent before a child that is as likely), so heapq.nlargest picks the likeliest."""

    chance: float  # the product of the draft's probabilities along its path
    order: int  # offered as the order-th
    token: int
    parent: _Node | None  # None: a child of the root

    def __lt__(self, other: _Node) -> bool:
        return (self.chance, -self.order) < (other.chance, -other.order)

    def path(self) -> list[int]:
        tokens, node = [], self
        while node is not None:
            tokens.append(node.token)
            node = node.parent
        return tokens[::-1]
