"""The fast paths' matrix products: one copy of each weight, in the layout the CPU's kernels
want (oneDNN's), or weight-only int8 (one int8 weight and one float scale per output row).

int8 cuts the products' memory 4x (fp32) or 2x (bf16). On CPUs it runs through
`aten._weight_int8pack_mm`; whether that is faster than the float product depends on the
machine, so `specdecode profile --quantize int8` measures it rather than assuming.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode.cpu import has_amx, has_avx512
from specdecode.runners.opaque import onednn_linear

QUANTIZATIONS = (None, "int8")
ONEDNN_ROWS = 16  # the row count oneDNN lays a reordered weight out for; 1-500 rows measured no slower
ONEDNN_INVARIANT_ROWS = 32  # most rows per oneDNN product whose results do not depend on each other
ONE_ROW_SAME_INPUTS = 1024  # most inputs for which oneDNN's one-row kernel sums as its many-row one


@dataclass(frozen=True)
class Projection:
    """y = x W^T + b. One copy of W, in the layout its kernel wants:
    - `reordered`: oneDNN's blocked layout (CPU, float32 or half precision), made once;
    - `scales` given: weight-only int8 codes, one float scale per output row;
    - else the plain [out, in] matrix, for F.linear (other devices).
    """

    weight: torch.Tensor  # [out, in], in one of the layouts above
    bias: torch.Tensor | None = None  # [out]
    scales: torch.Tensor | None = None  # [out], only for an int8 weight
    reordered: bool = False
    # oneDNN's one-row kernel may round a row differently from its kernel for 2-32 rows: on an
    # AMD EPYC with AVX512-BF16 and no AMX, products of more than 1024 inputs (a guess: its sum
    # is blocked otherwise beyond that) gave some rows other bits alone than beside others, in bfloat16 depending
    # on the data (~1e-4 of the outputs), in float32 nearly all; up to 1024 inputs, none of
    # 262144 outputs differed, for 64 to 1024 inputs, in either dtype (measured, 256 rows, 1 vs
    # 5 rows a product). On AMX CPUs 1 to 32 rows agreed in bfloat16. So one row runs padded to
    # two where it has more than 1024 inputs, without AMX, and in float32 also with AMX, whose
    # tiles do not multiply float32 (its kernels are the AVX-512 ones measured above); on CPUs
    # without AVX-512, whose kernels were not measured, always (_pads_one_row). Padding
    # costs a second row of a memory-bound product: a one-row product of SmolLM2's 960 x 576
    # q|k|v weight took 45 us alone and 61 us padded.
    pad_one_row: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.scales is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales.to(x.dtype))
            return y if self.bias is None else y + self.bias
        if not self.reordered:
            return F.linear(x, self.weight, self.bias)
        # oneDNN computes a row the same whatever rows share its product up to 32 rows,
        # not beyond (measured): in chunks of 32 a row never depends on its batch
        if x.shape[0] <= ONEDNN_INVARIANT_ROWS:  # decoding and verification: no copy
            return self._onednn(x)
        # a last chunk of one row takes the one-row kernel too: padded where that differs
        return torch.cat([self._onednn(chunk) for chunk in x.split(ONEDNN_INVARIANT_ROWS)])

    @property
    def is_copy(self) -> bool:
        """Whether the weight is held in a layout of its own (not the tensor it was made from)."""
        return self.reordered or self.scales is not None

    @property
    def nbytes(self) -> int:
        """Bytes this product keeps (oneDNN's reordered layout holds as many as the plain matrix)."""
        tensors = [t for t in (self.bias, self.scales) if t is not None]
        return self.weight.numel() * self.weight.element_size() + sum(t.numel() * t.element_size() for t in tensors)

    def _onednn(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.pad_one_row:
            return self._onednn_kernel(F.pad(x, (0, 0, 0, 1)))[:1]
        return self._onednn_kernel(x)

    def _onednn_kernel(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def projection(weight: torch.Tensor, bias: torch.Tensor | None, quantization: str | None) -> Projection:
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    if quantization is None and onednn_layout(weight):
        # F.linear reorders a half-precision weight for oneDNN on every call, and runs float32
        # through MKL, whose products of 2-16 rows cost 2-4x one row; reordered once, oneDNN
        # runs 1-16 rows for about the cost of one (measured on the default model, 2 threads:
        # a float32 forward of 1 token 37 -> 18 ms, of 5 tokens 56-59 -> 19-22 ms; bfloat16
        # products of one row 24.9 -> 16.2 ms) and computes each row the same whatever rows
        # share its product (what exact verification and batching need). bfloat16 results
        # are F.linear's bit for bit.
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), ONEDNN_ROWS)
        bias = bias.clone() if bias is not None else None  # all of it apart from the model's tensors
        return Projection(reordered, bias, reordered=True, pad_one_row=_pads_one_row(weight))
    if quantization is None:
        return Projection(weight, bias)
    if quantization != "int8":
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {QUANTIZATIONS}")
    # symmetric per-row scale: the row's largest magnitude maps to 127
    scales = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 127.0
    quantized = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Projection(quantized, bias, scales)


def _pads_one_row(weight: torch.Tensor) -> bool:  # [out, in]
    """Whether one row runs padded to two (see Projection.pad_one_row): not in half precision on
    AMX; with AVX-512 only beyond 1024 inputs; always on CPUs without AVX-512, whose kernels
    were not measured."""
    if weight.dtype != torch.float32 and has_amx():
        return False
    return weight.shape[1] > ONE_ROW_SAME_INPUTS or not has_avx512()


def onednn_layout(weight: torch.Tensor) -> bool:
    """Whether a weight is kept reordered for oneDNN: on a CPU build with it, whose processor
    oneDNN runs that dtype on (its float16 path needs AVX512-FP16 or AVX-NE-CONVERT: an AMD
    EPYC with AVX-512 but neither was seen to refuse it)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
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
