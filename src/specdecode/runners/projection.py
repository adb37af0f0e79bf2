"""The fast paths' matrix products: float weights in the layout the CPU's kernels want, or
weight-only int8 (one int8 weight and one float scale per output row).

int8 cuts the products' memory 4x (fp32) or 2x (bf16). On CPUs it runs through
`aten._weight_int8pack_mm`; whether that is faster than the float product depends on the
machine, so `specdecode profile --quantize int8` measures it rather than assuming.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdecode.runners.cpu import has_amx

QUANTIZATIONS = (None, "int8")
ONEDNN_ROWS = 16  # the row count oneDNN lays a reordered weight out for; 1-500 rows measured no slower
ONEDNN_INVARIANT_ROWS = 32  # most rows per oneDNN product whose results do not depend on each other


@dataclass(frozen=True)
class Projection:
    """y = x W^T + b, with W [out, in] in the model's dtype, or in int8 with per-row scales.

    `packed` holds float W also in MKL's packed GEMM layout for some row counts m: F.linear
    is slow on CPU for 4 to 16 rows (verification, batches), and a packed product of m rows
    costs about what F.linear costs for m / 2 (measured: benchmarks/results/profile.txt).
    x with n rows, m / 2 <= n <= m, is padded to m rows; rows are computed independently,
    so the padding does not change them. Other n (one row: plain decoding) use F.linear.
    A half-precision W on the CPU is kept reordered for oneDNN instead (`onednn`).
    """

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None = None  # [out]
    scales: torch.Tensor | None = None  # [out], only for an int8 weight
    onednn: torch.Tensor | None = None  # half-precision W reordered for oneDNN (CPU), see projection()
    packed: dict[int, torch.Tensor] = field(default_factory=dict)  # rows (ascending) -> W packed for them
    # oneDNN's one-row kernel may round a row differently from its kernel for 2-32 rows: on an
    # AMD EPYC with AVX512-BF16 and no AMX, products with 1536 inputs gave some rows other bits
    # alone than beside others, depending on the data, while 2 to 32 rows always agreed
    # (measured; on AMX CPUs 1 to 32 rows agreed). Without AMX one row runs padded to two.
    pad_one_row: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.scales is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales.to(x.dtype))
            return y if self.bias is None else y + self.bias
        if self.onednn is not None:
            # oneDNN computes a row the same whatever rows share its product up to 32 rows,
            # not beyond (measured): in chunks of 32 a row never depends on its batch
            if x.shape[0] <= ONEDNN_INVARIANT_ROWS:  # decoding and verification: no copy
                return self._onednn(x)
            # a last chunk of one row takes the one-row kernel too: padded where that differs
            return torch.cat([self._onednn(chunk) for chunk in x.split(ONEDNN_INVARIANT_ROWS)])
        n = x.shape[0]
        # padding to more than twice the rows costs more than it saves (measured: profile.txt)
        rows = next((m for m in self.packed if m // 2 <= n <= m), None)  # packed sizes ascend
        if rows is None:
            return F.linear(x, self.weight, self.bias)
        padded = x if n == rows else F.pad(x, (0, 0, 0, rows - n))
        return torch.ops.mkl._mkl_linear(padded, self.packed[rows], self.weight, self.bias, rows)[:n]

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.pad_one_row:
            return self._onednn_kernel(F.pad(x, (0, 0, 0, 1)))[:1]
        return self._onednn_kernel(x)

    def _onednn_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")


def projection(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None, packed_rows: tuple[int, ...] = ()
) -> Projection:
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    if quantization is None and onednn_packing(weight):
        # F.linear reorders a bfloat16 weight for oneDNN on every call; reordered once, the
        # products of 1-16 rows run ~30% faster and give F.linear's results bit for bit
        # (measured on this CPU: 30 layers' products of one row 24.9 -> 16.2 ms). For float16
        # F.linear computes a row differently with other rows beside it, the reordered
        # product does not (what FastLlamaRunner's exact verification needs); one row costs
        # ~10% more, 5-100 rows 10-25% less.
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_ROWS)
        return Projection(weight, bias, onednn=reordered, pad_one_row=not has_amx())
    if quantization is None:
        return Projection(
            weight, bias, packed={m: _mkl_pack(weight, m) for m in sorted(packed_rows) if mkl_packing(weight)}
        )
    if quantization != "int8":
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    # symmetric per-row scale: the row's largest magnitude maps to 127
    scales = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
    quantized = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Projection(quantized, bias, scales)


def mkl_packing(weight: torch.Tensor) -> bool:
    """Whether MKL's packed GEMM applies: float32 on a CPU build with MKL."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available()


def onednn_packing(weight: torch.Tensor) -> bool:
    """Whether a half-precision weight is kept reordered for oneDNN: on a CPU build with it,
    whose processor oneDNN runs that dtype on (its float16 path needs AVX512-FP16 or
    AVX-NE-CONVERT: an AMD EPYC with AVX-512 but neither was seen to refuse it)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float16)
        and onednn_supports(weight.dtype)
    )


@functools.cache
def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN reorders (and so multiplies) weights of this dtype; asked once."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), ONEDNN_ROWS)
    except RuntimeError:
        return False
    return True


def _mkl_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), rows)
