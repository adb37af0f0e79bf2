"""What the decode loop needs from a model: the `ModelRunner` protocol.

A runner runs new tokens against its KV cache and returns their logits, and crops the cache
back to a shorter length. The transformers runner (hf.py) runs any causal LM; the fast
paths (fast_llama.py, fast_gpt2.py) run supported families on a static cache.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ModelRunner(Protocol):
    vocab_size: int  # width of the logits
    dtype: torch.dtype  # of its weights and cache
    max_length: int  # context window, in tokens
    # declared capability: forward_batch(caches, token_ids, num_logits) runs several
    # sequences, each on a cache of its own, in one pass (runners/slots.py uses it)
    stacks_sequences: bool
    # declared: a sequence's logits have the same bits whatever shares its forward (other
    # sequences, other verified tokens); what an exact response cache needs
    batch_invariant: bool
    # declared: a prompt run after a cached prefix of it gives bitwise the cache and logits of
    # running it whole from an empty cache (its prefills attend and multiply row by row), so a
    # slot may keep a prefix for a later prompt that starts with it (runners/slots.py)
    reuses_prefixes: bool
    # declared: compile() makes its forwards run compiled by torch.compile, with the same results
    compilable: bool
    # declared: crop(n) puts the cache back exactly as it was after n tokens, so rejected drafts
    # leave no trace; False (a recurrent state, transformers' Mamba layers): the target decodes
    # target-only, and a crop empties the cache (cache_length says so)
    rolls_back: bool
    # declared: forward(..., parents) runs a tree of new tokens in one pass, each token's logits
    # bitwise those of decoding its path alone, and keep() moves a path to consecutive
    # positions; False: pass parents=None (a chain), and keep() only crops
    verifies_trees: bool
    # the layers whose hidden states a forward keeps (a draft head reads them; 0: the
    # embeddings, i: layer i's output); (): none. A runner that records none ignores it.
    hidden_layers: tuple[int, ...]
    # what the last forward kept of its new rows: [n, len(hidden_layers), hidden], a list of
    # them for a forward_batch (one per sequence), or None (none asked for, or none recorded)
    hidden: torch.Tensor | list[torch.Tensor] | None

    @property
    def cache_length(self) -> int: ...

    def reset(self) -> None:
        """Empty the cache, for a new sequence."""

    def forward(self, token_ids: torch.Tensor, num_logits: int, parents: torch.Tensor | None = None) -> torch.Tensor:
        """Run token_ids [n] after the cached ones; return the last num_logits logits [num_logits, vocab].
        parents [n] int64 (only where verifies_trees): token i's parent among the new tokens, or
        -1; token i then stands at position cache_length + its depth, and every row's logits
        are asked for."""

    def crop(self, length: int) -> None:
        """Keep only the first `length` cached positions."""

    def keep(self, start: int, offsets: list[int]) -> None:
        """Of the last forward's new tokens, written after `start` cached positions, keep those
        at `offsets` (increasing) at positions start, start + 1, ...: a crop when offsets is
        range(m); otherwise (verifies_trees) a root-to-node path of the last tree."""

    def release_model_weights(self) -> None:
        """Free the transformers model's copies of the weights this runner keeps in a layout of
        its own, so that they are held once; the model cannot run afterwards."""


class CompilableRunner(ModelRunner, Protocol):
    """A runner whose `compilable` is True."""

    def compile(self) -> None:
        """Make the forwards for one sequence run compiled by torch.compile, with the same results."""
