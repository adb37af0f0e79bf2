"""Model execution behind one small interface, and a KV cache kept in step with a sequence.

`ModelRunner` is all the decode loop needs from a model: run new tokens against the
cache and return their logits, and crop the cache back to a shorter length. A faster
runner (static cache, fused kernels) can replace `HFModelRunner` without touching the
loop. `CachedSequence` decides what to crop and what to run: speculative decoding
appends draft tokens and, after a rejection, rolls back to the accepted prefix; only the
new suffix is ever computed, and the prompt is prefilled once.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel


class ModelRunner(Protocol):
    vocab_size: int  # width of the logits
    max_length: int  # context window, in tokens

    @property
    def cache_length(self) -> int: ...

    def reset(self) -> None:
        """Empty the cache, for a new sequence."""

    def forward(self, token_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Run token_ids [n] after the cached ones; return the last num_logits logits [num_logits, vocab]."""

    def crop(self, length: int) -> None:
        """Keep only the first `length` cached positions."""


class HFModelRunner:
    """A transformers causal LM with a DynamicCache, one sequence at a time."""

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        config = model.config.get_text_config()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(
            getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
        )
        self.device = model.device
        self.reset()

    @property
    def cache_length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.model.config)
        # sliding-window layers must keep past states until cropped, or rollback is impossible
        self._cache.activate_past_recording()
        self._length = 0

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        out = self.model(
            input_ids=token_ids.to(self.device)[None],
            cache=self._cache,  # updated in place
            use_cache=True,
            logits_to_keep=num_logits,
        )
        self._length += token_ids.shape[0]
        return out.logits[0, -num_logits:].float().cpu()

    def crop(self, length: int) -> None:
        if length < self._length:
            # transformers 5.x: a negative argument removes that many positions from the end
            self._cache.crop(length - self._length)
            self._length = length


class StaticKVCache:
    """Keys and values of every layer in preallocated tensors, for the fast runners.

    Rolling back is `crop(n)`: rows past n are overwritten by the next forward, so nothing
    is copied or freed. Capacity doubles when a sequence outgrows it.
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, head_dim: int, max_length: int, dtype, device, capacity: int = 1024
    ):
        self.shape = (num_layers, num_kv_heads, 0, head_dim)
        self.max_length, self.dtype, self.device = max_length, dtype, device
        self.length = 0
        self.capacity = 0
        self.keys = self.values = torch.empty(self.shape, dtype=dtype, device=device)
        self._grow(min(capacity, max_length))

    def empty_copy(self, capacity: int) -> StaticKVCache:
        """A new, empty cache of the same shape, for another sequence."""
        layers, heads, _, dim = self.shape
        return StaticKVCache(layers, heads, dim, self.max_length, self.dtype, self.device, capacity)

    def reserve(self, num_new: int) -> None:
        """Make room for num_new more positions."""
        if self.length + num_new > self.capacity:
            self._grow(max(self.length + num_new, 2 * self.capacity))

    def write(
        self,
        layer: int,
        keys: torch.Tensor,  # [kv_heads, n, head_dim], for positions length .. length + n - 1
        values: torch.Tensor,  # [kv_heads, n, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # all keys and values so far: [kv_heads, length + n, head_dim]
        end = self.length + keys.shape[1]
        self.keys[layer, :, self.length : end] = keys
        self.values[layer, :, self.length : end] = values
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def advance(self, num_new: int) -> None:
        """The positions written by the last forward (every layer) are now cached."""
        self.length += num_new

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def causal_mask(self, num_new: int) -> torch.Tensor | None:
        """[num_new, length + num_new] bool: a new token sees the cache and the new tokens up to itself."""
        if num_new == 1:
            return None  # one query sees everything
        mask = torch.ones(num_new, self.length + num_new, dtype=torch.bool, device=self.device)
        return mask.tril(diagonal=self.length)

    def _grow(self, capacity: int) -> None:
        capacity = min(capacity, self.max_length)
        layers, heads, _, dim = self.shape
        keys = torch.empty(layers, heads, capacity, dim, dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        keys[:, :, : self.length] = self.keys[:, :, : self.length]
        values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values, self.capacity = keys, values, capacity


class StaticCacheRunner:
    """The cache half of ModelRunner for runners that keep a StaticKVCache in `self.cache`."""

    cache: StaticKVCache

    @property
    def cache_length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        self.cache.crop(0)

    def crop(self, length: int) -> None:
        self.cache.crop(length)


RUNNERS = ("auto", "fast", "transformers")


def runner_for(model: PreTrainedModel, runner: str = "auto", quantization: str | None = None) -> ModelRunner:
    """The fastest runner that supports the model: a lean fast path where one applies, else transformers'."""
    from specdecode.errors import InvalidArgumentError
    from specdecode.fast_llama import FastLlamaRunner

    if runner not in RUNNERS:
        raise InvalidArgumentError(f"unknown runner '{runner}'; choose one of: {', '.join(RUNNERS)}")
    fast = _fast_runner_class(model) if runner != "transformers" else None
    if runner == "fast" and fast is None:
        raise InvalidArgumentError(
            f"the fast runner supports Llama-family (llama, mistral, qwen2) and GPT-2 models, "
            f"not {model.config.model_type}; use --runner auto"
        )
    if quantization is None:
        return fast(model) if fast is not None else HFModelRunner(model)
    if fast is not FastLlamaRunner:
        raise InvalidArgumentError(
            f"--quantize {quantization} runs on the Llama-family fast runner, not on {model.config.model_type} models"
        )
    return FastLlamaRunner(model, quantization)


def _fast_runner_class(model: PreTrainedModel) -> type | None:
    from specdecode import fast_gpt2, fast_llama

    for module, runner_class in ((fast_llama, fast_llama.FastLlamaRunner), (fast_gpt2, fast_gpt2.FastGPT2Runner)):
        if module.supports(model):
            return runner_class
    return None


class CachedSequence:
    """A runner whose cache always holds a prefix of the sequence last asked about."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.runner.reset()
        self._tokens: list[int] = []

    def logits(self, token_ids: list[int], num_logits: int = 1) -> torch.Tensor:
        """Logits [num_logits, vocab] after each of the last num_logits positions of token_ids."""
        keep = min(_common_prefix_length(self._tokens, token_ids), len(token_ids) - num_logits)
        self.runner.crop(keep)  # roll back rejected tokens; never recompute the accepted ones
        logits = self.runner.forward(torch.tensor(token_ids[keep:], dtype=torch.long), num_logits)
        self._tokens = list(token_ids)
        return logits


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])
