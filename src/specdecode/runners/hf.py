"""Any transformers causal LM as a ModelRunner, on a DynamicCache."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class HFModelRunner:
    """A transformers causal LM with a DynamicCache, one sequence at a time."""

    stacks_sequences = False

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        config = model.config.get_text_config()
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048))
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
