"""Several sequences on one model: each in a slot with a KV cache of its own, run together.

A slot is a shallow copy of the engine's runner (the weights are shared) with its own cache.
Runners that declare `stacks_sequences` (FastLlamaRunner) run every slot's new tokens in one
forward; the others run the slots one after the other, which is correct but no faster.
Slots are made when first needed and kept for the next sequence; a slot given back gives
back the memory a long sequence made its cache take (`SlotPool.release`).
"""

from __future__ import annotations

import copy

import torch

from specdecode.runners.base import ModelRunner
from specdecode.runners.hf import HFModelRunner
from specdecode.runners.static_cache import StaticCacheRunner

SLOT_CAPACITY = 256  # positions a slot's cache starts with (and returns to); it doubles when a sequence needs more


class SlotPool:
    def __init__(self, runner: ModelRunner, max_length: int | None = None):
        """max_length: the most positions a slot's cache holds (default: the model's context)."""
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_length = runner.max_length if max_length is None else max_length
        self.slots: list[ModelRunner] = []
        self._free: list[int] = []

    def acquire(self) -> int:
        """A slot with an empty cache."""
        if not self._free:
            self.slots.append(_with_own_cache(self.runner, self.max_length))
            self._free.append(len(self.slots) - 1)
        slot = self._free.pop()
        self.slots[slot].crop(0)
        return slot

    def release(self, slot: int) -> None:
        """The slot's sequence has left: its cache is emptied, and shrinks back to SLOT_CAPACITY
        positions (transformers': a new, empty DynamicCache), so that one long sequence does
        not keep its memory in an idle slot."""
        runner = self.slots[slot]
        if isinstance(runner, StaticCacheRunner):
            runner.cache.crop(0)
            runner.cache.shrink(SLOT_CAPACITY)
        else:
            runner.reset()  # a crop would keep the long tensors' storage (transformers crops by views)
        self._free.append(slot)

    def crop(self, slot: int, length: int) -> None:
        self.slots[slot].crop(length)

    def keep(self, slot: int, start: int, offsets: list[int]) -> None:
        """ModelRunner.keep on the slot's cache: the accepted path of its last forward."""
        self.slots[slot].keep(start, offsets)

    def cache_length(self, slot: int) -> int:
        """Positions the slot's cache really holds (after a failed forward, maybe fewer than asked)."""
        return self.slots[slot].cache_length

    def forward(
        self,
        slots: list[int],
        token_ids: list[torch.Tensor],  # [n_i] new tokens of each slot, after its cached ones
        num_logits: list[int],
        parents: list[torch.Tensor | None] | None = None,  # per slot: [n_i] int64 (a tree) or None (a chain)
    ) -> list[torch.Tensor]:  # [num_logits[i], vocab] per slot
        if self.runner.stacks_sequences and len(slots) > 1:
            caches = [self.slots[s].cache for s in slots]
            if parents is None or all(p is None for p in parents):  # chains: the call as before trees
                return self.runner.forward_batch(caches, token_ids, num_logits)
            return self.runner.forward_batch(caches, token_ids, num_logits, parents=parents)
        parents = [None] * len(slots) if parents is None else parents
        return [
            self.slots[s].forward(t, n) if p is None else self.slots[s].forward(t, n, p)
            for s, t, n, p in zip(slots, token_ids, num_logits, parents, strict=True)
        ]


def kv_bytes_per_token(runner: ModelRunner) -> int:
    """Bytes of KV cache one position of a sequence takes: keys and values, of every layer's
    key/value heads, in the cache's dtype (for transformers' runner, read from the config; 0 for
    a model without attention)."""
    if isinstance(runner, StaticCacheRunner):
        layers, heads, _, dim = runner.cache.shape
        dtype = runner.cache.dtype
    elif isinstance(runner, HFModelRunner):
        config = runner.model.config.get_text_config()
        query_heads = getattr(config, "num_attention_heads", None)
        if not query_heads:  # no attention (Mamba): a fixed-size recurrent state, nothing per position
            return 0
        layers = config.num_hidden_layers
        heads = getattr(config, "num_key_value_heads", None) or query_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // query_heads
        dtype = runner.model.dtype
    else:
        raise TypeError(f"cannot tell the KV cache size of a {type(runner).__name__}")
    return 2 * layers * heads * dim * dtype.itemsize


def _with_own_cache(runner: ModelRunner, max_length: int) -> ModelRunner:
    slot = copy.copy(runner)  # shares the weights
    if isinstance(runner, StaticCacheRunner):
        slot.cache = runner.cache.empty_copy(SLOT_CAPACITY, max_length)
    elif not isinstance(runner, HFModelRunner):  # its reset() makes a new DynamicCache
        raise TypeError(f"cannot give a {type(runner).__name__} a cache of its own for batching")
    slot.reset()
    return slot
