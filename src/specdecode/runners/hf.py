"""Any transformers causal LM as a ModelRunner, on a DynamicCache."""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache, PreTrainedModel, cache_utils

from specdecode.loading import give_freed_memory_back, quantization_of
from specdecode.runners.rowwise import make_rows_exact, verifying

# transformers' linear-attention cache layers (and hybrids): a crop cannot take their
# recurrent state back
_RECURRENT_LAYERS = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())


class HFModelRunner:
    """A transformers causal LM with a DynamicCache, one sequence at a time."""

    stacks_sequences = False
    batch_invariant = False  # transformers' kernels round a row by what shares its product
    compilable = False

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        # bitsandbytes rounds its layers' inputs: verified rows must get their one-token bits,
        # or speculation drifts from the quantized model's own output (rowwise.py)
        self._rows_exact = quantization_of(model) is not None
        self._copied = make_rows_exact(model) if self._rows_exact else []
        config = model.config.get_text_config()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048))
        self.device, self.dtype = model.device, model.dtype
        self.reset()

    @property
    def cache_length(self) -> int:
        return self._length

    def release_model_weights(self) -> None:
        """Free the original weights of the layers a bitsandbytes model runs on oneDNN's
        products (rowwise.make_rows_exact), which hold a copy; the model still runs. On the CPU
        bitsandbytes repacks each 4-bit layer on its first forward, through temporaries that
        glibc keeps (measured: ~100 MB on the default model): one forward now, then the memory
        goes back too."""
        for module in self._copied:
            module.to("meta")
        self._copied = []
        if quantization_of(self.model) in ("nf4", "fp4") and self.device.type == "cpu":
            self.forward(torch.zeros(1, dtype=torch.long), 1)
            self.reset()
        give_freed_memory_back()

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.model.config)
        # sliding-window layers must keep past states until cropped, or rollback is impossible
        self._cache.activate_past_recording()
        self._length = 0

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        verification = self._rows_exact and self._length > 0 and token_ids.shape[0] > 1
        try:
            with verifying() if verification else contextlib.nullcontext():
                out = self.model(
                    input_ids=token_ids.to(self.device)[None],
                    cache=self._cache,  # updated in place
                    use_cache=True,
                    logits_to_keep=num_logits,
                )
        except BaseException:
            # a forward that fails part-way (out of memory, an interrupt) has appended the new
            # positions to the layers that ran and not to the others: take them off again
            self._restore()
            raise
        self._length += token_ids.shape[0]
        return out.logits[0, -num_logits:].float().cpu()

    def crop(self, length: int) -> None:
        if length < self._length:
            self._crop_layers(length, self._length)
            self._length = length

    def _restore(self) -> None:
        """Every layer back to the cached length after a failed forward (or an empty cache,
        where a recurrent state the failed forward may have advanced cannot be taken back)."""
        if any(isinstance(layer, _RECURRENT_LAYERS) for layer in self._cache.layers):
            self.reset()
        else:
            self._crop_layers(self._length, self._length)

    def _crop_layers(self, length: int, cached: int) -> None:
        """Keep the first `length` positions of every layer, by the length each one really
        holds (after a failed forward they differ); `cached`: what layers that report no
        length of their own (linear attention, transformers' DummyLayer) are taken to hold."""
        for layer in self._cache.layers:
            held = layer.get_seq_length() if isinstance(layer, cache_utils.CacheLayerMixin) else cached
            if held > length:
                # transformers 5.x: a negative argument removes that many positions from the end
                layer.crop(length - held)
