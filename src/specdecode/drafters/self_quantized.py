"""The target itself, in lower precision, drafts for the full-precision target.

Same tokenizer and nearly the same distribution, so drafts are accepted often; exact,
because the full-precision target verifies every token. It pays only where the low
precision forward is cheaper than the full one (bfloat16 on AMX or GPUs, int8 with fused
kernels); scripts in benchmarks/ measure that on the machine at hand.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel

from specdecode.drafters.model import ModelDrafter
from specdecode.errors import InvalidArgumentError
from specdecode.runners import HFModelRunner, fast_llama, runner_for
from specdecode.runners.projection import projection

QUANTIZATIONS = ("bfloat16", "int8")


class Int8Linear(nn.Module):
    """An nn.Linear stand-in whose weight is weight-only int8 (runners.projection.Projection)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.projection = projection(linear.weight, linear.bias, "int8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.projection(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def quantized_copy(model: PreTrainedModel, quantization: str) -> PreTrainedModel:
    """A copy of model in bfloat16, or with every decoder Linear weight-only int8 (head kept)."""
    if quantization not in QUANTIZATIONS:
        raise InvalidArgumentError(f"unknown quantization '{quantization}'; choose one of: {', '.join(QUANTIZATIONS)}")
    clone = copy.deepcopy(model)
    if quantization == "bfloat16":
        return clone.to(torch.bfloat16).eval()
    head = clone.get_output_embeddings()
    for parent in list(clone.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child is not head:
                setattr(parent, name, Int8Linear(child))
    return clone.eval()


def self_quantized_drafter(
    model: PreTrainedModel, quantization: str = "bfloat16", min_confidence: float = 0.0
) -> ModelDrafter:
    if quantization == "int8" and fast_llama.supports(model):
        runner = runner_for(model, quantization="int8")  # the fast path's own int8 products, no copy
    elif quantization == "int8":
        runner = HFModelRunner(quantized_copy(model, quantization))  # Int8Linear modules, through transformers
    else:
        runner = runner_for(quantized_copy(model, quantization))
    return ModelDrafter(runner, min_confidence, name=f"self-quantized-{quantization}")
