"""One target pass over each training sample: the hidden states the head reads, the last layer's
(its regression target, and through the target's norm and head rows its soft labels), and the
target's argmax at every position (positions whose argmax is outside the head's vocabulary
teach it nothing it could draft, and are masked, as EAGLE-3 does)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specdecode.runners.base import ModelRunner
from specdecode.runners.hf import HFModelRunner
from specdecode.training.data import Sample


@dataclass(frozen=True)
class Example:
    tokens: torch.Tensor  # [T] int64, prompt and answer
    features: torch.Tensor  # [T, len(feature_layers), hidden], in the target's dtype
    last: torch.Tensor  # [T, hidden], the last layer's output before the final norm
    argmax: torch.Tensor  # [T] int64, the target's most probable next token after each position
    answer_start: int  # the first answer token's index


def collect(
    target: PreTrainedModel | ModelRunner,
    samples: list[Sample],
    feature_layers: tuple[int, ...],
    max_length: int,
    on_sample: Callable[[int], None] | None = None,
) -> list[Example]:
    """An Example per sample, each cut to max_length tokens, from one forward of the target each.
    target: a model (run by transformers' runner) or a runner that keeps hidden states (the
    engine's: the fast runner's features are the ones the head reads when it drafts, and its
    half-precision products do not reorder their weights on every call as F.linear's do)."""
    runner = HFModelRunner(target) if isinstance(target, PreTrainedModel) else target
    kept_before = runner.hidden_layers
    try:
        return _collect(runner, samples, feature_layers, max_length, on_sample)
    finally:
        runner.reset()
        runner.hidden_layers = kept_before


def _collect(runner, samples, feature_layers, max_length, on_sample) -> list[Example]:
    last = runner.model.config.get_text_config().num_hidden_layers
    runner.hidden_layers = tuple(sorted(set(feature_layers) | {last}))
    columns = [runner.hidden_layers.index(i) for i in feature_layers]
    examples = []
    for i, sample in enumerate(samples):
        tokens = torch.tensor((sample.prompt_ids + sample.answer_ids)[:max_length], dtype=torch.long)
        if tokens.shape[0] > len(sample.prompt_ids):
            runner.reset()
            logits = runner.forward(tokens, tokens.shape[0])  # [T, vocab]
            hidden = runner.hidden.clone()  # a plain tensor, not an inference one: training reads it
            examples.append(
                Example(tokens, hidden[:, columns], hidden[:, -1], logits.argmax(-1), len(sample.prompt_ids))
            )
        if on_sample is not None:
            on_sample(i + 1)
    return examples
