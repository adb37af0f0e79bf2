"""The fast paths' matrix products: one copy of each weight, in the layout the CPU's kernels
want (oneDNN's), or weight-only int8 (one int8 weight and one float scale per output row).

int8 cuts the products' memory 4x (fp32) or 2x (bf16). On CPUs it runs through
`aten._weight_int8pack_mm`; whether that is faster than the float product depends on the
machine, so `specdecode profile --quantization int8-weight-only` measures it rather than assuming.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode import precision
from specdecode.cpu import cpu_flags, has_amx, has_avx512, kernel_isa_forced
from specdecode.kernels import int8_kernel
from specdecode.runners.opaque import onednn_linear

ONEDNN_ROWS = 16  # the row count oneDNN lays a reordered weight out for (other counts run as fast)
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
    # oneDNN's one-row kernel may round a row differently from its kernel for 2-32 rows (where
    # and how often: benchmarks/results/earlier-measurements.md): without AMX, products of more
    # than 1024 inputs gave some rows other bits alone than beside others, and none up to 1024;
    # with AMX, 1 to 32 rows agreed in bfloat16. So one row runs padded to two beyond 1024
    # inputs without AMX, in float32 also with AMX (whose tiles do not multiply float32), and
    # always on CPUs without AVX-512, whose kernels were not checked (_pads_one_row). Padding
    # costs a second row of a memory-bound product: less than a second product.
    pad_one_row: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self.scales is not None:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales.to(x.dtype))
            return y if self.bias is None else y + self.bias
        if not self.reordered:
            return F.linear(x, self.weight, self.bias)
        # oneDNN computes a row the same whatever rows share its product up to 32 rows,
        # not beyond (tests/runners/test_fast_runners.py): in chunks of 32 a row never depends on its batch
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
        if x.dtype is self.weight.dtype:  # the usual case: no conversion calls (a few us each) in the loop
            return onednn_linear(x, self.weight, self.bias)
        # a widened weight (onednn_dtype) multiplies the rows widened, rounded back once
        return onednn_linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def projection(
    weight: torch.Tensor, bias: torch.Tensor | None, quantization: precision.Quantization | str | None
) -> Projection:
    """quantization: None (the weight as it is) or int8-weight-only (w8a8's products are
    int8_projection's)."""
    quantization = precision.quantization_named(quantization, precision.RUNNER)
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    if quantization is None and onednn_layout(weight):
        # F.linear reorders a half-precision weight for oneDNN on every call, and runs float32
        # through MKL, whose products of several rows cost several times one row; reordered
        # once, oneDNN runs 1-16 rows for about the cost of one (docs/speed.md) and computes
        # each row the same whatever rows share its product (what exact verification and
        # batching need). bfloat16 results are F.linear's bit for bit where oneDNN multiplies
        # bfloat16; where it multiplies float32 only, the weight is held widened (see onednn_dtype).
        widened = weight.to(onednn_dtype(weight.dtype)).contiguous()
        reordered = torch.ops.mkldnn._reorder_linear_weight(widened, ONEDNN_ROWS)
        bias = bias.to(widened.dtype, copy=True) if bias is not None else None  # apart from the model's tensors
        return Projection(reordered, bias, reordered=True, pad_one_row=_pads_one_row(widened))
    if quantization is None:
        return Projection(weight, bias)
    if quantization is not precision.INT8_WEIGHT_ONLY:
        raise ValueError(f"projection() stores int8-weight-only products; {quantization.name}'s are int8_projection's")
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
    """Whether a weight is kept reordered for oneDNN: on a CPU build with it, in its dtype or
    widened to float32 (onednn_dtype)."""
    return weight.device.type == "cpu" and onednn_dtype(weight.dtype) is not None


def onednn_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype oneDNN multiplies a weight of this dtype in, on this CPU: its own where oneDNN
    runs it; float32 for a half-precision weight where oneDNN runs float32 only (a CPU without
    AVX512-BF16 or AMX for bfloat16, without AVX512-FP16 or AVX-NE-CONVERT for float16), the
    weight held widened (exactly: twice its memory) and each product's rows widened and rounded
    back once, as a half-precision product accumulates in float32 and rounds once. Nothing
    promises that F.linear keeps rows apart there (MKL's float32 products do not), and several
    rows cost it several one-row products (benchmarks/results/widened-products.md). None where
    oneDNN runs neither."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if onednn_supports(dtype):
        return dtype
    return torch.float32 if onednn_supports(torch.float32) else None


def row_independent_products(dtype: torch.dtype) -> bool:
    """Whether the fast paths' float products of this dtype compute a row the same whatever rows
    share its product, on this CPU: oneDNN's, in the dtype or widened (onednn_dtype)."""
    return onednn_dtype(dtype) is not None


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


# oneDNN's instruction-set caps below VNNI (every other cap includes it)
ISAS_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_CORE")
ACTIVATION_ZERO_POINT = 128  # int8 activations travel as uint8 codes + 128, the kernel's u8 x s8 form


@dataclass(frozen=True)
class Int8Projection:
    """y = x W^T + b with int8 weights and int8 activations (the `w8a8` quantization): W holds
    int8 codes per output channel (one float scale each), every row of x is quantized on a scale
    of its own, from that row alone, and a kernel sums code products in int32: this package's
    own (int8_kernel.py, on CPUs with AVX512-VNNI: `compensation` given) or oneDNN's prepacked one.

    Why a row's result cannot depend on the rows beside it: integer sums are exact whatever the
    kernel's blocking or the row count, each sum is multiplied by its column's weight scale (one
    float product per element: one rounding, the same in every kernel), and the row's own scale
    is applied after, element by element. tests/kernels/test_w8a8.py checks it bit for bit, with
    a negative control (one activation scale for the whole batch), and checks that both kernels
    give the same bits.

    On CPUs without VNNI (AVX512-VNNI, AVX-VNNI or AMX), oneDNN multiplies u8 x s8 pairs into
    saturating 16-bit sums; weights of 7 bits (|code| <= 63) keep every pair sum in range, so the
    sums stay exact there too (`weight_limit`). The own kernel sums 8-bit ones exactly on every
    build, so only a product it cannot pack (or a machine where it did not build) gets 7 bits."""

    # oneDNN's prepacked int8 weight (torch.ops.onednn.qlinear_prepack), or with `compensation`
    # the codes in int8_kernel's layout (Int8Kernel.pack): one copy either way
    weight: torch.Tensor
    scales: torch.Tensor  # [out] float32: the weight scale of each output channel
    zero_points: torch.Tensor | None  # [out] int64 zeros (symmetric weights) for oneDNN; None with compensation
    bias: torch.Tensor | None  # [out], in the activations' dtype
    shape: tuple[int, int]  # (out, in)
    compensation: torch.Tensor | None = None  # [out] int32: 128 x each channel's code sum (own kernel)
    limit: int = int8_kernel.WEIGHT_LIMIT  # the largest weight code (weight_limit)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] in x's dtype
        # the own layout is made only where int8_kernel loaded, and a loaded kernel stays loaded
        if self.compensation is not None and row_quantization is None and _own_kernel_takes_x(x, self.bias):
            return int8_kernel.load().quantized_product(x, self.weight, self.compensation, self.scales, self.bias)
        codes, row_scales = (row_quantization or quantize_rows)(x)
        if self.compensation is not None and _own_kernel_takes(codes, row_scales, self.bias, x.dtype):
            return int8_kernel.load().product(
                codes, row_scales, self.weight, self.compensation, self.scales, self.bias, x.dtype
            )
        sums = self.sums(codes)
        return epilogue(sums, row_scales, self.bias, x.dtype)  # [n, out]

    def sums(self, codes: torch.Tensor) -> torch.Tensor:  # uint8 [n, in] -> [n, out] float32
        """Each row's integer sums times its columns' weight scales (before the row's scale)."""
        if self.compensation is not None:  # the own layout, through the float32 epilogue
            ones = torch.ones(codes.shape[0], 1)
            return int8_kernel.load().product(
                codes, ones, self.weight, self.compensation, self.scales, None, torch.float32
            )
        return torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, ACTIVATION_ZERO_POINT, self.weight, self.scales, self.zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip

    @property
    def is_copy(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        """Bytes this product keeps: one int8 code per weight (and the own layout's padding of its
        last group), a float scale and a zero point or a compensation per channel."""
        codes = self.weight.numel() if self.compensation is not None else self.shape[0] * self.shape[1]
        tensors = [t for t in (self.scales, self.zero_points, self.compensation, self.bias) if t is not None]
        return codes + sum(t.numel() * t.element_size() for t in tensors)


def _own_kernel_takes(codes, row_scales, bias, dtype) -> bool:
    return (
        dtype in int8_kernel.DTYPES
        and codes.is_contiguous()
        and row_scales.dtype == torch.float32
        and row_scales.shape == (codes.shape[0], 1)
        and (bias is None or (bias.dtype == dtype and bias.is_contiguous()))
    )


def _own_kernel_takes_x(x: torch.Tensor, bias: torch.Tensor | None) -> bool:  # [n, in]
    return int8_kernel.Int8Kernel.supports(x) and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous()))


def quantize_rows(
    x: torch.Tensor,  # [n, in]
) -> tuple[torch.Tensor, torch.Tensor]:  # uint8 codes [n, in] (zero point 128), float32 scales [n, 1]
    """Each row on its own symmetric scale: its largest magnitude maps to 127. One C call
    (int8_kernel.py) where it is built, else torch's operations: the same bits either way."""
    kernel = int8_kernel.load()
    if kernel is not None and kernel.supports(x):
        return kernel.quantize_rows(x)
    return quantize_rows_torch(x)


# None: rows are quantized as quantize_rows does, which the fused calls (the one-call product,
# the C decoder layers) do inside. Another row quantization set here (a test's negative control:
# one scale for the whole batch) makes every product call it, and the fused calls step aside.
row_quantization: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


def quantize_rows_torch(
    x: torch.Tensor,  # [n, in]
) -> tuple[torch.Tensor, torch.Tensor]:  # uint8 codes [n, in] (zero point 128), float32 scales [n, 1]
    """quantize_rows in torch's operations: the arithmetic the C kernel gives bit for bit."""
    x = x.float()
    scales = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(1e-30).div_(127.0)
    codes = torch.round(x / scales).add_(ACTIVATION_ZERO_POINT).to(torch.uint8)
    return codes, scales


def epilogue(
    sums: torch.Tensor,  # [n, out] float32: integer sums times their columns' weight scales
    row_scales: torch.Tensor,  # [n, 1] float32
    bias: torch.Tensor | None,  # [out] of dtype
    dtype: torch.dtype,
) -> torch.Tensor:  # [n, out] of dtype
    """Each row's sums times its scale, rounded to the activations' dtype, plus the bias: one C
    call where it is built, else torch's operations (the same bits)."""
    kernel = int8_kernel.load()
    if kernel is not None and kernel.epilogue_supports(sums, row_scales, bias, dtype):
        return kernel.epilogue(sums, row_scales, bias, dtype)
    return epilogue_torch(sums, row_scales, bias, dtype)


def epilogue_torch(sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """epilogue in torch's operations: the arithmetic the C kernel gives bit for bit."""
    y = (sums * row_scales).to(dtype)
    return y if bias is None else y + bias


@dataclass(frozen=True)
class W8A16Projection:
    """y = x W^T + b with int8 weights and 16-bit integer activations (`w8a16`; fast_llama's
    Int8Recipe.w8a16 names the products): W holds int8 codes per output channel as w8a8's do (in
    int8_kernel's packed layout with its compensation where that kernel runs, else the plain
    [out, in] codes), and every row of x is quantized on a scale of its own to integers of at most
    int8_kernel.wide_activation_limit(in) (16383 for the model's sizes): a 256 times finer grid
    than w8a8's, for a product (the output head) whose int8 activations cost perplexity.

    Exact for the reason w8a8 is: the integer sums are exact (the C kernel's two byte sums, or
    float64 products of integers below 2^53 here), then the w8a8 epilogue element by element; a
    row's result is a function of that row alone, and both paths give the same bits
    (tests/runners/test_w8a16_head.py)."""

    weight: torch.Tensor  # packed codes (with compensation) or [out, in] int8 codes
    scales: torch.Tensor  # [out] float32
    bias: torch.Tensor | None  # [out], in the activations' dtype
    shape: tuple[int, int]  # (out, in)
    compensation: torch.Tensor | None = None  # [out] int32: 128 x each channel's code sum (own kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] in x's dtype
        kernel = int8_kernel.load() if self.compensation is not None else None  # packed only where it ran
        if wide_row_quantization is None and kernel is not None and _own_kernel_takes_x(x, self.bias):
            return kernel.wide_quantized_product(x, self.weight, self.compensation, self.scales, self.bias)
        codes, row_scales = (wide_row_quantization or wide_quantize_rows_torch)(x)
        if kernel is not None and _own_kernel_takes(codes, row_scales, self.bias, x.dtype):
            return kernel.wide_product(
                codes, row_scales, self.weight, self.compensation, self.scales, self.bias, x.dtype
            )
        return epilogue_torch(self.reference_sums(codes), row_scales, self.bias, x.dtype)

    def codes(self) -> torch.Tensor:  # [out, in] int8
        if self.compensation is None:
            return self.weight
        return int8_kernel.Int8Kernel.unpack(self.weight, self.shape[0])

    def reference_sums(self, codes: torch.Tensor) -> torch.Tensor:  # int32 [n, in] -> [n, out] float32
        """Each row's exact integer sums times its columns' weight scales, in torch: float64
        products and sums of integers, every partial sum below 2^31 < 2^53, so exact in any
        order; to float32 (to nearest even, as the C kernel's int32 conversion), then one float32
        product with the weight scale. In chunks of output channels (a float64 copy of the head's
        codes would be 8 bytes a weight)."""
        weight = self.codes()
        activations = codes.double()
        chunks = [activations @ chunk.double().T for chunk in weight.split(4096)]
        return torch.cat(chunks, dim=1).float() * self.scales

    @property
    def is_copy(self) -> bool:
        return True

    @property
    def nbytes(self) -> int:
        tensors = [t for t in (self.scales, self.compensation, self.bias) if t is not None]
        return self.weight.numel() + sum(t.numel() * t.element_size() for t in tensors)


# None: rows are quantized as wide_quantize_rows_torch does (and the one-call C product inside).
# Another set here (a test's negative control) makes W8A16Projection call it.
wide_row_quantization: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None


def wide_quantize_rows_torch(
    x: torch.Tensor,  # [n, in]
) -> tuple[torch.Tensor, torch.Tensor]:  # int32 codes [n, in], float32 scales [n, 1]
    """w8a16's row quantization in torch's operations (the C kernel's bits): each row on its own
    symmetric scale, its largest magnitude mapping to int8_kernel.wide_activation_limit(in)."""
    limit = int8_kernel.wide_activation_limit(x.shape[1])
    x = x.float()
    scales = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True).clamp_min_(1e-30).div_(float(limit))
    codes = torch.round(x / scales).nan_to_num_(0.0).clamp_(-limit, limit).to(torch.int32)  # NaN rows: NaN results
    return codes, scales


def w8a16_projection(weight: torch.Tensor, bias: torch.Tensor | None) -> W8A16Projection:  # weight [out, in]
    """The w8a16 product of a float weight: int8 codes per output channel (8 bits wherever it
    runs: its sums never pass through oneDNN's 16-bit pairs), packed for this package's kernel
    where it runs (own_kernel), else kept plain for the torch path."""
    weight = weight.detach().float()
    limit = int8_kernel.WEIGHT_LIMIT
    scales = weight.abs().amax(dim=1).clamp_min(1e-30) / limit  # [out] float32
    codes = torch.round(weight / scales[:, None]).clamp_(-limit, limit).to(torch.int8)
    bias = bias.detach().clone() if bias is not None else None
    shape = (weight.shape[0], weight.shape[1])
    kernel = own_kernel()
    if kernel is not None and kernel.packs(shape):
        compensation = codes.sum(dim=1, dtype=torch.int32) * ACTIVATION_ZERO_POINT
        return W8A16Projection(kernel.pack(codes), scales, bias, shape, compensation)
    return W8A16Projection(codes, scales, bias, shape)


def int8_projection(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Projection:  # weight [out, in]
    """The w8a8 product of a float weight: int8 codes per output channel, packed for this
    package's kernel where it runs (own_kernel), else prepacked for oneDNN."""
    weight = weight.detach().float()
    shape = (weight.shape[0], weight.shape[1])
    kernel = own_kernel()
    own = kernel is not None and kernel.packs(shape)
    limit = int8_kernel.WEIGHT_LIMIT if own else weight_limit()
    scales = weight.abs().amax(dim=1).clamp_min(1e-30) / limit  # [out] float32
    codes = torch.round(weight / scales[:, None]).clamp_(-limit, limit).to(torch.int8)
    bias = bias.detach().clone() if bias is not None else None
    if own:  # the codes in its layout only: no oneDNN copy
        compensation = codes.sum(dim=1, dtype=torch.int32) * ACTIVATION_ZERO_POINT
        return Int8Projection(kernel.pack(codes), scales, None, bias, shape, compensation, limit)
    packed = torch.ops.onednn.qlinear_prepack(codes, [1, weight.shape[1]])
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int64)
    return Int8Projection(packed, scales, zero_points, bias, shape, limit=limit)


class CodedEmbedding:
    """Token embeddings read from the int8 codes of an output head tied to them: row t is code
    row t times channel t's scale, in float32, rounded to the model's dtype. A w8a8 runner whose
    head was quantized from a tied embedding (SmolLM2's) then needs no second, 16-bit copy of
    that matrix (49,152 x 576 x 2 bytes = 56.6 MB there). 8-bit embeddings make another model,
    as 8-bit products do: docs/quantization.md states its perplexity."""

    def __init__(self, head: Int8Projection | W8A16Projection, dtype: torch.dtype):
        self.head, self.dtype = head, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [n] int64 -> [n, hidden] of dtype
        return (code_rows(self.head.weight, ids).float() * self.head.scales[ids, None]).to(self.dtype)


def code_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # -> [n, in] int8
    """Output channels `ids` of int8 codes [out, in], or of int8_kernel's packed layout
    [groups, in / 4, GROUP, 4] (a channel's codes: one column of every quad)."""
    if weight.dim() == 2:
        return weight[ids]
    group = weight.shape[2]
    return weight[ids // group, :, ids % group].reshape(ids.shape[0], -1)  # [n, in / 4, 4] -> [n, in]


def coded_embedding(head: object, dtype: torch.dtype) -> CodedEmbedding | None:
    """The embedding in a quantized head's codes, where they can be read: not in oneDNN's
    prepacked weight (an opaque tensor), whose w8a8 heads keep the embedding as it is."""
    if isinstance(head, W8A16Projection) or (isinstance(head, Int8Projection) and head.compensation is not None):
        return CodedEmbedding(head, dtype)
    return None


def own_kernel() -> int8_kernel.Int8Kernel | None:
    """This package's int8 product kernel where it runs: a vectorized build (AVX512-VNNI or AVX2,
    whichever cpu.kernel_isa chose), or the portable one where SPECDECODE_KERNEL_ISA forces it.
    Each sums 8-bit weights exactly in int32, where oneDNN without VNNI needs 7-bit ones, and
    gives oneDNN's bits; it is faster for few rows, and the C decoder layers need it."""
    kernel = int8_kernel.load()
    if kernel is None or (kernel.isa == "portable" and not kernel_isa_forced()):
        return None
    return kernel


def weight_limit() -> int:
    """The largest weight code of a product in oneDNN's layout: 127 with VNNI, else 63 (see
    Int8Projection). The own kernel's are always 127 (int8_kernel.WEIGHT_LIMIT)."""
    return 127 if has_vnni() else 63


def has_vnni() -> bool:
    """Whether oneDNN's int8 products sum u8 x s8 pairs in 32 bits here (VNNI or AMX). A cap on
    oneDNN's instruction set below VNNI (ONEDNN_MAX_CPU_ISA) counts as none."""
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    if capped in ISAS_WITHOUT_VNNI:
        return False
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & cpu_flags())


@functools.cache
def int8_supported() -> bool:
    """Whether this torch build has oneDNN's int8 products and they run here; asked once."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return False
    try:
        int8_projection(torch.ones(16, 16), None)(torch.ones(2, 16))
    except (RuntimeError, AttributeError):
        return False
    return True
