"""Weight-only int8: one int8 weight and one float scale per output row.

Memory for the quantized products drops 4x (fp32) or 2x (bf16). On CPUs the product runs
through `aten._weight_int8pack_mm`; whether that is faster than the float product depends
on the machine, so `specdecode profile --quantize int8` measures it rather than assuming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QUANTIZATIONS = (None, "int8")


@dataclass(frozen=True)
class Projection:
    """y = x W^T + b, with W [out, in] in the model's dtype, or in int8 with per-row scales."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None  # [out]
    scales: torch.Tensor | None = None  # [out], only for an int8 weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.scales is None:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales.to(x.dtype))
        return y if self.bias is None else y + self.bias


def projection(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None) -> Projection:
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    if quantization is None:
        return Projection(weight, bias)
    if quantization != "int8":
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    # symmetric per-row scale: the row's largest magnitude maps to 127
    scales = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
    quantized = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Projection(quantized, bias, scales)
