"""Several sequences on one model: each in a slot with a KV cache of its own, run together.

A slot is a shallow copy of the engine's runner (the weights are shared) with its own cache.
Runners that can stack sequences (FastLlamaRunner.forward_batch) run every slot's new tokens
in one forward; the others run the slots one after the other, which is correct but no faster.
"""

from __future__ import annotations

import copy

import torch

from specdecode.kv_cache import HFModelRunner, ModelRunner, StaticCacheRunner

SLOT_CAPACITY = 256  # positions a slot's cache starts with; it doubles when a sequence needs more


class BatchRunner:
    def __init__(self, runner: ModelRunner, num_slots: int):
        self.vocab_size, self.max_length = runner.vocab_size, runner.max_length
        self.slots = [_with_own_cache(runner) for _ in range(num_slots)]
        self._forward_batch = getattr(runner, "forward_batch", None)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def cache_length(self, slot: int) -> int:
        return self.slots[slot].cache_length

    def crop(self, slot: int, length: int) -> None:
        self.slots[slot].crop(length)

    def forward(
        self,
        slots: list[int],
        token_ids: list[torch.Tensor],  # [n_i] new tokens of each slot, after its cached ones
        num_logits: list[int],
    ) -> list[torch.Tensor]:  # [num_logits[i], vocab] per slot
        if self._forward_batch is not None and len(slots) > 1:
            return self._forward_batch([self.slots[s].cache for s in slots], token_ids, num_logits)
        return [self.slots[s].forward(t, n) for s, t, n in zip(slots, token_ids, num_logits)]


def _with_own_cache(runner: ModelRunner) -> ModelRunner:
    slot = copy.copy(runner)  # shares the weights
    if isinstance(runner, StaticCacheRunner):
        slot.cache = runner.cache.empty_copy(SLOT_CAPACITY)
    elif not isinstance(runner, HFModelRunner):  # its reset() makes a new DynamicCache
        raise TypeError(f"cannot give a {type(runner).__name__} a cache of its own for batching")
    slot.reset()
    return slot
