"""Several sequences on one model: each in a slot with a KV cache of its own, run together.

A slot is a shallow copy of the engine's runner (the weights are shared) with its own cache.
Runners that declare `stacks_sequences` (FastLlamaRunner) run every slot's new tokens in one
forward; the others run the slots one after the other, which is correct but no faster.
Slots are made when first needed and kept for the next sequence.
"""

from __future__ import annotations

import copy

import torch

from specdecode.runners.base import ModelRunner
from specdecode.runners.hf import HFModelRunner
from specdecode.runners.static_cache import StaticCacheRunner

SLOT_CAPACITY = 256  # positions a slot's cache starts with; it doubles when a sequence needs more


class SlotPool:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.vocab_size, self.max_length = runner.vocab_size, runner.max_length
        self.slots: list[ModelRunner] = []
        self._free: list[int] = []

    def acquire(self) -> int:
        """A slot with an empty cache."""
        if not self._free:
            self.slots.append(_with_own_cache(self.runner))
            self._free.append(len(self.slots) - 1)
        slot = self._free.pop()
        self.slots[slot].crop(0)
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def crop(self, slot: int, length: int) -> None:
        self.slots[slot].crop(length)

    def forward(
        self,
        slots: list[int],
        token_ids: list[torch.Tensor],  # [n_i] new tokens of each slot, after its cached ones
        num_logits: list[int],
    ) -> list[torch.Tensor]:  # [num_logits[i], vocab] per slot
        if self.runner.stacks_sequences and len(slots) > 1:
            return self.runner.forward_batch([self.slots[s].cache for s in slots], token_ids, num_logits)
        return [self.slots[s].forward(t, n) for s, t, n in zip(slots, token_ids, num_logits, strict=True)]


def _with_own_cache(runner: ModelRunner) -> ModelRunner:
    slot = copy.copy(runner)  # shares the weights
    if isinstance(runner, StaticCacheRunner):
        slot.cache = runner.cache.empty_copy(SLOT_CAPACITY)
    elif not isinstance(runner, HFModelRunner):  # its reset() makes a new DynamicCache
        raise TypeError(f"cannot give a {type(runner).__name__} a cache of its own for batching")
    slot.reset()
    return slot
