"""The target itself, in lower precision, drafts for the full-precision target.

Same tokenizer and nearly the same distribution, so drafts are accepted often; exact,
because the full-precision target verifies every token. It pays only where the low
precision forward is cheaper than the full one (bfloat16 on AMX or GPUs, int8 with fused
kernels); scripts in benchmarks/ measure that on the machine at hand. nf4 and fp4 are
bitsandbytes' 4-bit copies (the layers `--quantization nf4` gives a target), run by
transformers' runner. The copy's precision is named as --draft-quantization names it
(precision.draft_precision_named: bfloat16, int8-weight-only, nf4 or fp4).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel

from specdecode import precision
from specdecode.drafters.model import ModelDrafter
from specdecode.errors import InvalidArgumentError
from specdecode.loading import bnb_compute_dtype, check_4bit_layout, check_bitsandbytes, quantization_of
from specdecode.runners import HFModelRunner, fast_llama, runner_for
from specdecode.runners.projection import projection

DraftPrecision = precision.Dtype | precision.Quantization  # what --draft-quantization names


class Int8Linear(nn.Module):
    """An nn.Linear stand-in whose weight is weight-only int8 (runners.projection.Projection)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.projection = projection(linear.weight, linear.bias, precision.INT8_WEIGHT_ONLY)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.projection(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def bnb_4bit_linear(linear: nn.Linear, quant_type: str) -> nn.Module:
    """bitsandbytes' Linear4bit holding linear's weight in quant_type, quantized as transformers'
    BitsAndBytesConfig(load_in_4bit=True) quantizes it (blocks of 64, no double quantization)."""
    import bitsandbytes as bnb

    device = linear.weight.device
    layer = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=bnb_compute_dtype(device),
        compress_statistics=False,
        quant_type=quant_type,
        device="meta",
    )
    weight = linear.weight.detach().clone()
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, compress_statistics=False, quant_type=quant_type)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
    return layer.to(device)  # moving a Params4bit quantizes it


def quantized_copy(model: PreTrainedModel, quantization: str | DraftPrecision) -> PreTrainedModel:
    """A copy of model in bfloat16, or with every decoder Linear weight-only int8 or bitsandbytes
    nf4/fp4 (head kept, as transformers keeps it)."""
    chosen = precision.draft_precision_named(quantization)
    if quantization_of(model) is not None:
        raise InvalidArgumentError(
            f"the target is already quantized (bitsandbytes {quantization_of(model)}); the self-quantized drafter "
            "copies a float target: leave --quantization out, or pick another drafter",
            "drafter",
        )
    if chosen in precision.BNB_4BIT:
        check_bitsandbytes(model.device)
    clone = copy.deepcopy(model)
    if isinstance(chosen, precision.Dtype):
        return clone.to(chosen.dtype).eval()
    head = clone.get_output_embeddings()
    for parent in list(clone.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and child is not head:
                weight_only = chosen is precision.INT8_WEIGHT_ONLY
                setattr(parent, name, Int8Linear(child) if weight_only else bnb_4bit_linear(child, chosen.name))
    if chosen in precision.BNB_4BIT:
        check_4bit_layout(clone)
    return clone.eval()


def self_quantized_drafter(
    model: PreTrainedModel, quantization: str | DraftPrecision = "bfloat16", min_confidence: float = 0.0
) -> ModelDrafter:
    """quantization: the copy's precision, or its name as --draft-quantization spells it."""
    chosen = precision.draft_precision_named(quantization)
    weight_only = chosen is precision.INT8_WEIGHT_ONLY
    if quantization_of(model) is None and weight_only and fast_llama.supports(model):
        runner = runner_for(model, quantization=chosen)  # the fast path's own int8 products, no copy
    elif isinstance(chosen, precision.Quantization):
        # Int8Linear or bitsandbytes modules, through transformers
        runner = HFModelRunner(quantized_copy(model, chosen))
    else:
        runner = runner_for(quantized_copy(model, chosen))
    return ModelDrafter(runner, min_confidence, name=f"self-quantized-{chosen.name}")
