"""A KV cache in preallocated tensors, and the cache half of the fast runners."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specdecode.loading import copy_off_file_map
from specdecode.runners.opaque import write_rows
from specdecode.runners.projection import row_independent_products


class StaticKVCache:
    """Keys and values of every layer in preallocated tensors, for the fast runners.

    Rolling back is `crop(n)`: rows past n are overwritten by the next forward, so nothing
    is copied or freed. After a tree forward, `keep(start, offsets)` moves the accepted path's
    rows to consecutive positions. Capacity doubles when a sequence outgrows it, up to
    max_length; `shrink` gives the memory of a long sequence back.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, max_length: int, dtype, device, capacity: int = 1024
    ):
        self.shape = (num_layers, num_kv_heads, 0, head_dim)
        self.max_length, self.dtype, self.device = max_length, dtype, device
        self.length = 0
        self.capacity = 0
        # a tensor per layer, [kv_heads, capacity, head_dim]: a compiled forward writes each in
        # place (runners/opaque.py), where views of one tensor would be copied whole
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # the last forward's start and its tokens' parents (None: a chain), for keep() to check
        self._written: tuple[int, list[int] | None] | None = None
        self._grow(min(capacity, max_length))

    def empty_copy(self, capacity: int, max_length: int | None = None) -> StaticKVCache:
        """A new, empty cache of the same shape, for another sequence (that holds at most
        max_length positions, default this cache's)."""
        layers, heads, _, dim = self.shape
        max_length = self.max_length if max_length is None else max_length
        return StaticKVCache(layers, heads, dim, max_length, self.dtype, self.device, capacity)

    def reserve(self, num_new: int) -> None:
        """Make room for num_new more positions."""
        if self.length + num_new > self.capacity:
            self._grow(max(self.length + num_new, 2 * self.capacity))

    def shrink(self, capacity: int) -> None:
        """Give memory back: hold `capacity` positions (the cached ones, if more) when holding more."""
        capacity = max(min(capacity, self.max_length), self.length)
        if self.capacity > capacity:
            self._reallocate(capacity)

    def write(
        self,
        layer: int,
        keys: torch.Tensor,  # [kv_heads, n, head_dim], for positions length .. length + n - 1
        values: torch.Tensor,  # [kv_heads, n, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # all keys and values so far: [kv_heads, length + n, head_dim]
        return append(self.keys[layer], self.values[layer], self.length, keys, values)

    def advance(self, num_new: int, parents: list[int] | None = None) -> None:
        """The positions written by the last forward (every layer) are now cached; parents: of
        those tokens within them, for a tree (None: a chain)."""
        self._written = (self.length, parents)
        self.length += num_new

    def crop(self, length: int) -> None:
        if length < self.length:
            self._written = None
        self.length = min(self.length, length)

    def keep(self, start: int, offsets: list[int]) -> None:
        """Of the last forward's new tokens, written after `start` cached positions, keep those
        at `offsets` (into the new tokens) at positions start, start + 1, ...; the length becomes
        start + len(offsets). Other than a prefix (a crop), the offsets must be a path from a
        token of parent -1 down the last forward's tree: its rows were rotated by their depth,
        which is the position they move to."""
        offsets = list(offsets)
        if offsets == list(range(len(offsets))):
            if start + len(offsets) > self.length:
                raise ValueError(
                    f"keep({start}, {len(offsets)} offsets) reaches past the {self.length} cached positions"
                )
            self.crop(start + len(offsets))
            return
        written = self._written
        if written is None or written[0] != start or written[1] is None or not _is_path(written[1], offsets):
            raise ValueError(f"keep({start}, {offsets}): not a path of the last tree forward after {start} positions")
        index = torch.tensor(offsets, device=self.device) + start
        # a cache that grew during a forward (under inference mode) holds inference tensors, which
        # only inference mode may write in place; the cache's other tensors accept it as well
        with torch.inference_mode():
            for rows in self.keys + self.values:
                rows[:, start : start + len(offsets)] = rows[:, index]  # the gather copies before the write
        self.length = start + len(offsets)
        self._written = None

    def copy_rows(self, source: StaticKVCache, end: int) -> None:
        """Positions length .. end - 1 from source's cache, which holds the same tokens there (a
        prefill another sequence ran); the length becomes end."""
        if not self.length <= end <= source.length:
            raise ValueError(f"copy_rows to {end}: this cache holds {self.length}, the source {source.length}")
        self.reserve(end - self.length)
        with torch.inference_mode():  # see keep(): the caches may hold inference tensors
            for mine, theirs in zip(self.keys + self.values, source.keys + source.values):
                mine[:, self.length : end] = theirs[:, self.length : end]
        self.length, self._written = end, None

    def causal_mask(self, num_new: int) -> torch.Tensor | None:
        """[num_new, length + num_new] bool: a new token sees the cache and the new tokens up to itself."""
        if num_new == 1:
            return None  # one query sees everything
        mask = torch.ones(num_new, self.length + num_new, dtype=torch.bool, device=self.device)
        return mask.tril(diagonal=self.length)

    def _grow(self, capacity: int) -> None:
        self._reallocate(capacity)

    def _reallocate(self, capacity: int) -> None:
        """New tensors of `capacity` positions (at most max_length, at least length), the cached ones copied."""
        capacity = min(capacity, self.max_length)
        layers, heads, _, dim = self.shape
        empty = [torch.empty(heads, capacity, dim, dtype=self.dtype, device=self.device) for _ in range(2 * layers)]
        for new, old in zip(empty, self.keys + self.values):
            new[:, : self.length] = old[:, : self.length]
        self.keys, self.values, self.capacity = empty[:layers], empty[layers:], capacity

    @property
    def nbytes(self) -> int:
        """Bytes held for keys and values, every layer."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


def _is_path(parents: list[int], offsets: list[int]) -> bool:
    """Whether offsets go from a token of parent -1 down to a descendant, parent to child."""
    previous = -1
    for offset in offsets:
        if not 0 <= offset < len(parents) or parents[offset] != previous:
            return False
        previous = offset
    return True


def append(
    keys: torch.Tensor,  # [kv_heads, capacity, head_dim], one layer's cache
    values: torch.Tensor,  # [kv_heads, capacity, head_dim]
    length: int,  # positions cached before these
    new_keys: torch.Tensor,  # [kv_heads, n, head_dim], for positions length .. length + n - 1
    new_values: torch.Tensor,  # [kv_heads, n, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # all keys and values so far: [kv_heads, length + n, head_dim]
    """Write one layer's new keys and values after its cached ones (in place, compiled or not)."""
    end = length + new_keys.shape[1]
    write_rows(keys, length, new_keys)
    write_rows(values, length, new_values)
    return keys[:, :end], values[:, :end]


class StaticCacheRunner:
    """The cache half of ModelRunner for runners that keep a StaticKVCache in `self.cache`."""

    cache: StaticKVCache
    stacks_sequences = False  # FastLlamaRunner overrides: it has forward_batch
    compilable = False  # FastLlamaRunner overrides: it has compile()
    rolls_back = True  # keys and values only: rows past the length are overwritten
    verifies_trees = False  # FastLlamaRunner overrides: where its tree attention kernel runs
    reuses_prefixes = False  # FastLlamaRunner overrides: where its C layers prefill
    hidden_layers: tuple[int, ...] = ()  # FastLlamaRunner records them; the others keep none
    hidden: torch.Tensor | list[torch.Tensor] | None = None
    per_query_attention: bool

    @property
    def batch_invariant(self) -> bool:
        """On the CPU, whose verification attends one query at a time and whose oneDNN products
        keep rows independent (tests/runners/test_fast_runners.py); elsewhere kernels may round a row
        by the rows beside it."""
        return self.per_query_attention and row_independent_products(self.dtype)

    @property
    def cache_length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.crop(0)

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    def keep(self, start: int, offsets: list[int]) -> None:
        """See StaticKVCache.keep: a crop for a prefix of the new tokens, else a tree's path."""
        self.cache.keep(start, offsets)

    def release_model_weights(self) -> None:
        """The fast paths hold each product's weight in oneDNN's layout (or int8) on the CPU, and
        fused ones (q|k|v, gate|up) as new tensors: the model's own copies are then a second copy
        of most of its bytes. Freed (moved to the meta device), they leave one copy; the model
        itself refuses to run afterwards, saying why."""
        for module in self._copied_modules():
            module.to("meta")
        copy_off_file_map(self.model)  # the rest (embeddings, norms) may hold the file's pages
        self.model.register_forward_pre_hook(_refuse_released)

    def _copied_modules(self) -> Iterable[torch.nn.Module]:
        """The model's modules whose weights this runner holds a copy of."""
        raise NotImplementedError


class KeepsHiddenStates:
    """`hidden_layers` for a runner whose forwards keep layer inputs in `hidden` (a draft head
    reads them): FastLlamaRunner, FastTransformersRunner."""

    num_layers: int  # its decoder layers
    _hidden_layers: tuple[int, ...] = ()
    hidden: torch.Tensor | list[torch.Tensor] | None = None

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Which hidden states the next forwards keep in `hidden` (layer i's input; i = number of
        layers: the last layer's output, before the final norm); () keeps none."""
        return self._hidden_layers

    @hidden_layers.setter
    def hidden_layers(self, layers) -> None:
        layers = tuple(int(i) for i in layers)
        if any(not 0 <= i <= self.num_layers for i in layers):
            raise ValueError(f"hidden_layers {layers}: each in 0..{self.num_layers}")
        self._hidden_layers = layers
        self.hidden = None


def _refuse_released(module: torch.nn.Module, args: tuple) -> None:
    raise RuntimeError(
        "this transformers model's layer weights were freed: the fast runner keeps them in its own "
        "layout. Pass keep_model_weights=True to SpeculativeEngine.from_pretrained to run the model too."
    )
