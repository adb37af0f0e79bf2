"""Several sequences on one model: each in a slot with a KV cache of its own, run together.

A slot is a shallow copy of the engine's runner (the weights are shared) with its own cache.
Runners that declare `stacks_sequences` (FastLlamaRunner) run every slot's new tokens in one
forward; the others run the slots one after the other, which is correct but no faster.
Slots are made when first needed and kept for the next sequence; a slot given back gives
back the memory a long sequence made its cache take (`SlotPool.release`).

Prefix reuse: where the runner declares `reuses_prefixes` (a prompt run after a cached prefix
of it gives bitwise what running it whole gives), a slot given back keeps the positions its
sequence had cached, and `acquire_reusing` hands a new sequence the free slot that holds the
longest prefix of its prompt, cropped to it: a follow-up turn of a chat, or prompts sharing a
system prompt, prefill only what is new. The target's hidden states of those positions are
kept beside them for a draft head (`record_hidden`), which drafts from every position.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from specdecode.runners.base import ModelRunner
from specdecode.runners.cached import common_prefix_length
from specdecode.runners.hf import HFModelRunner
from specdecode.runners.static_cache import StaticCacheRunner

SLOT_CAPACITY = 256  # positions a slot's cache starts with (and returns to); it doubles when a sequence needs more


@dataclass
class _Held:
    """What a slot's cache holds, for prefix reuse: the tokens at its positions, and the
    target's hidden states of the first `known` of them (of `layers`, [positions, len(layers),
    hidden] in the runner's dtype)."""

    tokens: list[int] = field(default_factory=list)
    layers: tuple[int, ...] = ()
    hidden: torch.Tensor | None = None
    known: int = 0


class SlotPool:
    def __init__(self, runner: ModelRunner, max_length: int | None = None, reuse_prefixes: bool = True):
        """max_length: the most positions a slot's cache holds (default: the model's context);
        reuse_prefixes: where the runner allows it (module docstring)."""
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.max_length = runner.max_length if max_length is None else max_length
        self.slots: list[ModelRunner] = []
        self._free: list[int] = []  # the longest free first
        self._held: dict[int, _Held] = {}  # slot -> what it holds (reusing prefixes only)
        self.reuse_prefixes(reuse_prefixes)

    def reuse_prefixes(self, on: bool) -> None:
        """Switch prefix reuse on (where the runner allows it) or off (free slots forget what
        they hold)."""
        self.reuses_prefixes = on and getattr(self.runner, "reuses_prefixes", False)
        if not self.reuses_prefixes:
            self.forget_prefixes()

    def forget_prefixes(self) -> None:
        """Free slots keep nothing (after an engine crash, what they hold is not trusted)."""
        for slot in self._free:
            self.slots[slot].crop(0)
        self._held.clear()

    def acquire(self) -> int:
        """A slot with an empty cache."""
        return self.acquire_reusing([])[0]

    def acquire_reusing(
        self, prompt_ids: list[int], layers: tuple[int, ...] = ()
    ) -> tuple[int, int, torch.Tensor | None]:
        """A slot for a sequence whose prompt starts with prompt_ids, holding the longest prefix
        of them that a free slot has (at most all but the last, so that a prefill runs; where
        hidden states of `layers` are wanted, only positions whose states were kept): the slot,
        the prefix's length, and those states [length, len(layers), hidden] (None where none
        are wanted or none reused). 0 positions where the pool does not reuse prefixes."""
        if not self._free:
            self.slots.append(_with_own_cache(self.runner, self.max_length))
            self._free.insert(0, len(self.slots) - 1)
        if not self.reuses_prefixes:
            slot, length = self._free.pop(), 0
        else:
            reuse = {s: self._reusable(s, prompt_ids, layers) for s in self._free}
            slot = max(self._free, key=lambda s: reuse[s])  # the first of the longest: none reused, the longest free
            self._free.remove(slot)
            length = reuse[slot]
        self.slots[slot].crop(length)
        held = self._held.pop(slot, _Held())
        if self.reuses_prefixes:  # its hidden states stay known up to the prefix, written on from there
            self._held[slot] = _Held(held.tokens[:length], held.layers, held.hidden, min(held.known, length))
        if not length or not layers:
            return slot, length, None
        columns = [held.layers.index(layer) for layer in layers]
        return slot, length, held.hidden[:length, columns]

    def _reusable(self, slot: int, prompt_ids: list[int], layers: tuple[int, ...]) -> int:
        held = self._held.get(slot)
        if held is None:
            return 0
        length = min(common_prefix_length(held.tokens, prompt_ids), len(prompt_ids) - 1)
        if layers:
            length = min(length, held.known) if set(layers) <= set(held.layers) else 0
        return max(length, 0)

    def record_hidden(self, slot: int, start: int, hidden: torch.Tensor, layers: tuple[int, ...]) -> None:
        """The target's hidden states [m, len(layers), hidden] of the slot's positions start ..
        start + m - 1 (its sequence's accepted tokens), kept for a later sequence that reuses
        them; a gap, or other layers than those kept after position 0, keeps none after it."""
        if not self.reuses_prefixes:
            return
        held = self._held.setdefault(slot, _Held())
        if layers != held.layers:
            if start:
                held.known = 0
                return
            held.layers, held.hidden, held.known = layers, None, 0
        if start > held.known:
            return
        end = start + hidden.shape[0]
        if held.hidden is None or held.hidden.shape[0] < end:
            grown = torch.empty(max(end, 2 * held.known), *hidden.shape[1:], dtype=hidden.dtype)
            if held.hidden is not None:
                grown[: held.known] = held.hidden[: held.known]
            held.hidden = grown
        held.hidden[start:end] = hidden
        held.known = end

    def release(self, slot: int, tokens: list[int] | None = None) -> None:
        """The slot's sequence has left. Reusing prefixes, it keeps `tokens`, those its cache
        holds (a prefix of what the sequence cached; none given: nothing kept), for a later
        sequence; otherwise its cache is emptied. Either way the cache shrinks back to
        SLOT_CAPACITY positions, or to those it keeps (transformers': a new, empty
        DynamicCache), so that one long sequence does not keep more memory in an idle slot
        than it holds."""
        runner = self.slots[slot]
        kept = tokens[: runner.cache_length] if self.reuses_prefixes and tokens else []
        held = self._held.pop(slot, _Held())
        if kept:
            self._held[slot] = _Held(kept, held.layers, held.hidden, min(held.known, len(kept)))
        if isinstance(runner, StaticCacheRunner):
            runner.cache.crop(len(kept))
            runner.cache.shrink(SLOT_CAPACITY)
        else:
            runner.reset()  # a crop would keep the long tensors' storage (transformers crops by views)
        self._free.append(slot)

    def copy_rows(self, source: int, slot: int, end: int) -> None:
        """The slot's cache extended to `end` positions by copying source's, which holds the same
        tokens up to there (a prompt another sequence prefilled, pooled prefills only)."""
        self.slots[slot].cache.copy_rows(self.slots[source].cache, end)

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
