"""The drafter interface: propose a draft (a chain or a tree of tokens), then learn from the
target's verdict and logits.

Trees. A draft is a tree of candidate tokens whose root is the sequence's last token (already
chosen, not part of the draft). Node i has a token and a parent: `parents[i] < i` is the index
of another node, or -1 for the root; a node's depth is 1 + its parent's (the root's is 0), and
it stands at position len(tokens) - 1 + depth. A chain is the tree with parents [-1, 0, 1, ...],
which `parents=None` means. Nodes come in topological order (every parent before its
children), and the children of a node in the order the drafter trusts them, so the first path
(`first_path`) is the drafter's best chain.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from specdecode.core.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [n] int64, n may be smaller than asked for, or 0
    probs: torch.Tensor | None  # [n, vocab] the q each token was drawn from; None = one-hot
    source: str | None = None  # which drafter of a composite (auto) proposed it
    parents: torch.Tensor | None = None  # [n] int64, parents[i] < i or -1 (the root); None: a chain
    forced: int = 0  # its first `forced` tokens are a chain a grammar forced (decoder.py), not the drafter's
    forced_after: int = 0  # ... and its last ones what the grammar forces after the drafter's chain

    def __post_init__(self) -> None:
        if self.parents is not None and self.probs is not None:
            # several children drawn from q would need another accept rule (core/verification.py)
            raise ValueError("a tree draft is one-hot (probs None); stochastic drafts are chains")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> Draft:
        return Draft(torch.zeros(0, dtype=torch.long), None)

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def parent_list(self) -> list[int]:
        """parents[i] for every node (a chain's too)."""
        return list(range(-1, len(self) - 1)) if self.parents is None else self.parents.tolist()

    def depths(self) -> list[int]:
        """Depth of every node: 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parent_list():
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def first_path(self) -> Draft:
        """The chain of first children from the root: what a target that cannot verify trees runs."""
        if self.parents is None:
            return self
        path, parent = [], -1
        for i, p in enumerate(self.parents.tolist()):
            if p == parent:
                path.append(i)
                parent = i
        return replace(self, tokens=self.tokens[path], parents=None)


class Drafter(Protocol):
    """One-hot drafters (probs None) must draft deterministically from token_ids alone (and,
    if they declare depends_on_history, from what they learnt): then q is the point mass on
    their token and the accept/reject rule stays exact.

    k is chosen by the decoder (decoder.py), never by a drafter: the most tokens of a chain,
    or the most nodes of a tree. Capabilities are declared: `per_sequence` drafters give each
    sequence of a batch a state of its own with `fork()`; the others hold one shared state (a
    draft model's cache), so the decoder runs them on batches of one sequence. `drafts_trees`
    drafters may propose trees (a target that cannot verify them runs their first path).
    A drafter that declares `hidden_layers` (a draft head) is given the target's hidden states
    of those layers from the verifying forward (`learn_hidden`). `cache_identity` says what its
    proposals depend on, for the response cache.

    Every drafter subclasses this protocol: the members with a default (no hidden layers, no
    history, chains only, and methods that do nothing) are then its own unless it overrides
    them, and the decoder calls each member without asking whether it is there.
    """

    name: str
    per_sequence: bool
    # declared: drafts depend on earlier requests (a history, a shared store), not on the
    # sequence alone; seeded sampling skips such drafters, so that its samples repeat
    depends_on_history: bool = False
    drafts_trees: bool = False
    # declared: the target layers whose hidden states it reads (learn_hidden); (): none
    hidden_layers: tuple[int, ...] = ()

    def begin(self, prompt_ids: list[int]) -> None:
        """A new sequence starts with these prompt tokens."""

    def propose(
        self,
        token_ids: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Draft:
        """Up to k tokens (nodes) to follow token_ids, drawn with the same params as the target."""

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """How many of the last proposal's tokens the target accepted (a tree: its accepted depth)."""

    def learn(self, token_ids: list[int], draft: Draft, logits: torch.Tensor) -> None:
        """What the target predicted at this step: logits [len(draft) + 1, vocab], row 0 after
        token_ids[-1] (the root), row 1 + i after draft node i, whether accepted or not. Called
        for every verification of the sequence (a prefill's: one row, empty draft), whichever
        drafter proposed."""

    def learn_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """Only where hidden_layers: the target's hidden states [m, len(hidden_layers), hidden]
        of the tokens now accepted, at positions start .. start + m - 1."""

    def finish(self, token_ids: list[int]) -> None:
        """The sequence ended (or left) with these tokens, prompt included."""

    def fork(self) -> Drafter:
        """A drafter with the same settings for one more sequence (only if per_sequence)."""

    def cache_identity(self) -> list | None:
        """What decides its proposals besides the sequence and the target, JSON-able (its
        settings, a draft model's fingerprint): the response cache keys seeded samples by it,
        with the class's name (factory.drafter_identity). None, the default: it cannot say, and
        its seeded samples are not cached. Only the class that defines it is trusted: a subclass
        may propose otherwise, so it says what it adds by defining its own."""
        return None
