"""Token Recycling (Luo et al. 2024, arXiv 2408.08696): the target's own predictions, kept, draft
the next tokens without any model call.

A table holds, for every token, the target's top `width` candidates for the token after it,
rewritten from the logits of every position the target verifies (accepted or not, and a
prefill's last position). A draft is a tree expanded breadth-first from the sequence's last
token through the table, in a static shape per budget (drafters/tree.py: the nodes most
likely reached, if the candidate of rank r is the target's next token with chance
RANK_ACCEPTANCE[r]); siblings are the table's candidates in rank order, so the first path is
the table's greedy chain. A row never written proposes nothing below it.

When the sequence's last n-gram occurred before, prompt lookup's continuations (a trie,
drafters/prompt_lookup.py) come first, the table filling the rest of the budget, so this
drafter also covers prompts whose answers copy them.

The table is shared by every sequence (fork() shares it): a server that has run a while drafts
better than one request's own predictions would (the issue's replay of held-out prompts: 1.45
against 1.35 tokens per forward with 8 nodes). So its drafts depend on earlier requests, and
seeded sampling does not use it. Drafts stay deterministic given the table and the tokens, so
they are one-hot, and verification is exact whatever the table holds.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from specdecode.core.sampling import SamplingParams, row_maxima
from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.prompt_lookup import PromptLookupDrafter
from specdecode.drafters.tree import Acceptance, TreeBuilder, chain_share, tree_shape
from specdecode.errors import InvalidArgumentError

# The chance that the table's candidate of rank r is the target's next token, below the root
# and deeper (where a path that got there is a predictable one): the prior that shapes the tree,
# measured by replaying the default model's greedy answers to chat prompts (a table written
# from the true path only). Only the ratios and the two levels' difference shape the tree, so
# a table that has learnt more keeps the shape.
RANK_ACCEPTANCE: Acceptance = (
    (0.19, 0.085, 0.04, 0.02, 0.016, 0.013, 0.011, 0.01),
    (0.35, 0.14, 0.08, 0.05, 0.03, 0.02, 0.015, 0.012),
)
# the chance that a prompt-lookup token is the target's next one before any was verified; then
# each sequence's own rate (see RecyclingDrafter.learn) decides how many nodes the
# continuations take from the table's
LOOKUP_ACCEPTANCE = 0.5
LOOKUP_PRIOR_WEIGHT = 4.0  # pseudo-counts of the prior, so that a few verdicts move it
UNWRITTEN = -1  # a table entry no logits wrote yet
PENDING_ROWS = 64  # rows of logits a table holds back at most (TokenTable.write): their memory is bounded


class TokenTable:
    """[vocab + 1, width] int32 token ids: row t holds the target's top candidates, best first,
    for the token after t, as the logits last written to it ranked them. The extra last row
    stays UNWRITTEN: index -1 reads it, so an UNWRITTEN parent gathers UNWRITTEN children.

    Writes wait until the table is next read (`ids`), or until PENDING_ROWS rows wait: the
    drafters of a batch's sequences share one table and each writes after every step, so the
    step's writes then take one top-k over all their rows instead of one each (torch's
    per-call costs dominate a row or two)."""

    def __init__(self, vocab_size: int, width: int):
        if width < 1:
            raise InvalidArgumentError(f"the recycling table's width must be at least 1, got {width}", "width")
        self.vocab_size, self.width = vocab_size, width
        self._ids = torch.full((vocab_size + 1, width), UNWRITTEN, dtype=torch.int32)
        self._pending: list[tuple[list[int], torch.Tensor]] = []  # writes not applied yet, in order

    @property
    def ids(self) -> torch.Tensor:  # [vocab + 1, width] int32, every write so far applied
        self._apply_pending()
        return self._ids

    def write(self, rows: list[int], logits: torch.Tensor) -> None:
        """Row rows[i] from logits[i] ([n, vocab]); where a token repeats, its first row wins
        (the caller lists the surest context first), so a write does not depend on the order
        in which index_put resolves duplicates; a later write wins over an earlier one."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits over {logits.shape[-1]} tokens for a table of {self.vocab_size}")
        self._pending.append((rows, logits))
        if sum(len(written) for written, _ in self._pending) >= PENDING_ROWS:  # unread a while (target-only)
            self._apply_pending()

    def _apply_pending(self) -> None:
        """The writes held back, as if applied one after the other, in one top-k."""
        writes, self._pending = self._pending, []
        if not writes:
            return
        chosen: dict[int, int] = {}  # token -> its row among all the writes' rows
        offset = 0
        for rows, logits in writes:
            first: dict[int, int] = {}
            for i, token in enumerate(rows):
                first.setdefault(token, offset + i)
            chosen.update(first)
            offset += logits.shape[0]
        logits = writes[0][1] if len(writes) == 1 else torch.cat([logits for _, logits in writes])
        if len(chosen) < logits.shape[0]:
            logits = logits[list(chosen.values())]
        top = top_candidates(logits, min(self.width, self.vocab_size))  # [n, width]
        self._ids[torch.tensor(list(chosen), dtype=torch.long), : top.shape[1]] = top.to("cpu", torch.int32)

    def expand(self, root: int, budget: int, acceptance: Acceptance) -> tuple[list[int], tuple[int, ...]]:
        """The tokens of the static tree of `budget` nodes below root (UNWRITTEN where the
        table has none) and its parents: one gather per level, through a numpy view of the
        table (torch's per-call overhead would dominate gathers of a few entries)."""
        shape = _levels(budget, tuple(level[: self.width] for level in acceptance))  # no ranks past the width
        flat = self.ids.view(-1).numpy()  # entry (t, r) at t * width + r; t = -1 reads the last row
        tokens = np.empty(len(shape.parents) + 1, dtype=np.int64)  # [1 + nodes]: the root, then the nodes
        tokens[0] = root
        for nodes, parents, ranks in shape.levels:
            tokens[nodes] = flat[tokens[parents] * self.width + ranks]
        return tokens[1:].tolist(), shape.parents


def top_candidates(logits: torch.Tensor, width: int, block: int = 128) -> torch.Tensor:
    """The indices [n, width] of each row's `width` largest logits ([n, vocab]), largest first
    (ties in a fixed order). Two stages, exact: the largest entries lie in the `width` blocks
    of `block` entries with the largest maxima; one pass for the maxima, then a top-k over
    width * block candidates, where torch's CPU top-k over whole rows of a large vocabulary
    costs several times more."""
    n, vocab = logits.shape
    if vocab <= width * block:
        return logits.topk(width, dim=-1).indices
    rows = logits.float()
    if vocab % block:
        rows = torch.nn.functional.pad(rows, (0, block - vocab % block), value=float("-inf"))
    blocks = rows.view(n, -1, block)  # [n, blocks, block]
    best = blocks.amax(-1).topk(width, dim=-1).indices  # [n, width]
    candidates = blocks.gather(1, best.unsqueeze(-1).expand(n, width, block)).view(n, width * block)
    chosen = candidates.topk(width, dim=-1).indices  # [n, width] into the candidates
    return (best * block).gather(1, chosen // block) + chosen % block


class _Shape:
    """tree_shape's nodes grouped by depth, as index arrays into [root] + nodes."""

    def __init__(self, parents: tuple[int, ...], ranks: tuple[int, ...]):
        self.parents = parents
        depth: list[int] = []
        for parent in parents:
            depth.append(1 if parent < 0 else depth[parent] + 1)
        self.levels = []
        for d in range(1, max(depth, default=0) + 1):
            nodes = [i for i, node_depth in enumerate(depth) if node_depth == d]
            self.levels.append(
                (
                    np.array([i + 1 for i in nodes]),
                    np.array([parents[i] + 1 for i in nodes]),
                    np.array([ranks[i] for i in nodes]),
                )
            )


@lru_cache(maxsize=256)
def _levels(budget: int, acceptance: Acceptance) -> _Shape:
    return _Shape(*tree_shape(budget, acceptance))


class RecyclingDrafter(Drafter):
    name = "recycling"
    per_sequence = True  # forks share the table
    depends_on_history = True  # the table holds what earlier requests' logits wrote
    drafts_trees = True

    def __init__(
        self,
        vocab_size: int,
        width: int = 8,
        lookup: PromptLookupDrafter | None = None,
        tree: bool = True,
        table: TokenTable | None = None,
        rank_acceptance: Acceptance = RANK_ACCEPTANCE,
    ):
        """width: candidates kept per token; lookup: the prompt lookup whose continuations come
        first (a tree one; None: the table alone); tree=False: a chain (the first path), for a
        target that does not verify trees; table: another drafter's, to share; rank_acceptance:
        the prior that shapes the tree (RANK_ACCEPTANCE)."""
        self.table = table if table is not None else TokenTable(vocab_size, width)
        self.lookup = lookup
        self.tree = tree
        self.rank_acceptance = rank_acceptance
        # ranks past the table's width have no entries; a chain is the tree of one rank
        ranks = self.table.width if tree else 1
        self._shape_acceptance = tuple(level[:ranks] for level in rank_acceptance)
        self._lookup_rate = [LOOKUP_ACCEPTANCE * LOOKUP_PRIOR_WEIGHT, LOOKUP_PRIOR_WEIGHT]  # hits, tries
        self._proposed: tuple[list[int], list[int], int] | None = None  # tokens, parents, lookup nodes

    @property
    def width(self) -> int:
        return self.table.width

    def fork(self) -> RecyclingDrafter:
        lookup = self.lookup.fork() if self.lookup is not None else None
        return RecyclingDrafter(
            self.table.vocab_size, lookup=lookup, tree=self.tree, table=self.table, rank_acceptance=self.rank_acceptance
        )

    def begin(self, prompt_ids: list[int]) -> None:
        self._lookup_rate = [LOOKUP_ACCEPTANCE * LOOKUP_PRIOR_WEIGHT, LOOKUP_PRIOR_WEIGHT]  # each prompt its own
        self._proposed = None
        if self.lookup is not None:
            self.lookup.begin(prompt_ids)

    def finish(self, token_ids: list[int]) -> None:
        if self.lookup is not None:
            self.lookup.finish(token_ids)

    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        if k <= 0 or not token_ids:
            return Draft.empty()
        builder = TreeBuilder(k)
        if self.lookup is not None and self.tree:
            hits, tries = self._lookup_rate
            builder.budget = chain_share(k, hits / tries, self._shape_acceptance)  # the continuations' share
            self.lookup.add_to(builder, token_ids)
            builder.budget = k
        elif self.lookup is not None:  # a chain: the first continuation alone
            builder.add_path(next(self.lookup.continuations(token_ids, k), torch.zeros(0)).tolist())
        from_lookup = len(builder)
        if self.tree or not from_lookup:
            self._add_table(builder, token_ids[-1])
        self._proposed = (builder.tokens, builder.parents, from_lookup)
        return builder.draft() if len(builder) else Draft.empty()

    def _add_table(self, builder: TreeBuilder, root: int) -> None:
        """The table's tree below root, merged into builder's (best nodes first) while it has room."""
        tokens, parents = self.table.expand(root, builder.budget, self._shape_acceptance)
        placed: list[int | None] = []  # each shape node's node in builder (None: not placed)
        for token, parent in zip(tokens, parents, strict=True):
            above = -1 if parent < 0 else placed[parent]
            placed.append(None if token == UNWRITTEN or above is None else builder.child(above, token))

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass

    def learn(self, token_ids: list[int], draft: Draft, logits: torch.Tensor) -> None:
        """logits [len(draft) + 1, vocab]: row 0 after the sequence's last token, row 1 + i after
        draft node i; each rewrites its token's row of the table. If the draft is this drafter's
        last proposal, its prompt-lookup nodes also count towards the sequence's lookup rate."""
        tokens = draft.tokens.tolist()
        self.table.write([token_ids[-1], *tokens], logits)
        proposed, self._proposed = self._proposed, None
        if proposed is not None and proposed[2] and proposed[0] == tokens and proposed[1] == draft.parent_list():
            self._count_lookup(tokens, proposed[1], proposed[2], row_maxima(logits)[1].tolist())

    def _count_lookup(self, tokens: list[int], parents: list[int], nodes: int, predicted: list[int]) -> None:
        """Of the first `nodes` nodes (the lookup's), each one whose parent the target reached
        (the greedy path: predicted[0] after the root, predicted[1 + i] after node i) is a try,
        and a hit if it is the predicted token."""
        hit: list[bool] = []
        for i in range(nodes):
            parent = parents[i]
            if parent < 0 or hit[parent]:
                self._lookup_rate[1] += 1
                hit.append(tokens[i] == predicted[parent + 1])
                self._lookup_rate[0] += hit[-1]
            else:
                hit.append(False)
