"""Weight-only int8: one int8 weight and one float scale per output row.

Memory for the quantized products drops 4x (fp32) or 2x (bf16). On CPUs the product runs
through `aten._weight_int8pack_mm`; whether that is faster than the float product depends
on the machine, so `specdecode profile --quantize int8` measures it rather than assuming.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

QUANTIZATIONS = (None, "int8")


@dataclass(frozen=True)
class Projection:
    """y = x W^T + b, with W [out, in] in the model's dtype, or in int8 with per-row scales.

    `packed` holds float W also in MKL's packed GEMM layout for some row counts m: F.linear
    is slow on CPU for 4 to 16 rows (verification, batches), and a packed product of m rows
    costs about what F.linear costs for m / 2 (measured: benchmarks/results/profile.txt).
    x with n rows, m / 2 <= n <= m, is padded to m rows; rows are computed independently,
    so the padding does not change them. Other n (one row: plain decoding) use F.linear.
    """

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None  # [out]
    scales: torch.Tensor | None = None  # [out], only for an int8 weight
    packed: dict[int, torch.Tensor] = field(default_factory=dict)  # rows (ascending) -> W packed for them

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.scales is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales.to(x.dtype))
            return y if self.bias is None else y + self.bias
        n = x.shape[0]
        # padding to more than twice the rows costs more than it saves (measured: profile.txt)
        rows = next((m for m in self.packed if m // 2 <= n <= m), None)  # packed sizes ascend
        if rows is None:
            return F.linear(x, self.weight, self.bias)
        padded = x if n == rows else F.pad(x, (0, 0, 0, rows - n))
        return torch.ops.mkl._mkl_linear(padded, self.packed[rows], self.weight, self.bias, rows)[:n]


def projection(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None, packed_rows: tuple[int, ...] = ()
) -> Projection:
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    if quantization is None:
        return Projection(weight, bias, packed={m: _mkl_pack(weight, m) for m in sorted(packed_rows) if mkl_packing(weight)})
    if quantization != "int8":
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    # symmetric per-row scale: the row's largest magnitude maps to 127
    scales = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
    quantized = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Projection(quantized, bias, scales)


def mkl_packing(weight: torch.Tensor) -> bool:
    """Whether MKL's packed GEMM applies: float32 on a CPU build with MKL."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()


def _mkl_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), rows)
