"""The w8a8 products in C (csrc/w8a8.c): the per-row activation quantization, the epilogue (sums
times row scales, to the model's dtype, plus bias) and the whole product on the own packed
layout, built on first use (native.py) and loaded with ctypes.

It also runs w8a16 (projection.W8A16Projection): the same packed int8 weights times activations
quantized per row to ~15-bit integers, summed exactly in int32 (the C file states why), with the
w8a8 epilogue.

The source is built for one instruction set of cpu.KERNEL_ISAS (AMX, AVX512-VNNI, AVX2, portable C),
which cpu.kernel_isa chooses once per process from the CPU's flags, or SPECDECODE_KERNEL_ISA
forces. Every build gives the same bits (integer sums, then the same float32 operations in the
same order; tests/kernels/test_w8a8.py compares them on a CPU that runs all of them).

Each call replaces a sequence of torch operations (projection.quantize_rows_torch, and
`(sums * row_scales).to(dtype) + bias`) and gives their bits: the same float32 operations in the
same order, each element on its own (the C file states the arithmetic; tests/kernels/test_w8a8.py
compares them bit for bit). So a product's results do not depend on which path ran, and the
response cache's fingerprint does not name it. Without gcc, or if the build fails, `load()`
returns None (one warning in the log) and the products keep the torch operations.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import torch

from specdecode.cpu import kernel_isa, runnable_kernel_isas
from specdecode.kernels import native

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "w8a8.c"
ABI_VERSION = 5
GROUP = 64  # output columns of a packed group (the C file's GROUP)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
WIDE_ACTIVATION_LIMIT = 16383  # w8a16's largest activation code: 15 bits, whose high byte + 128 is a uint8
WEIGHT_LIMIT = 127  # the largest weight code of the own kernel's products

_lock = threading.Lock()
_loaded: dict[str, Int8Kernel | None] = {}
_ready: list[Int8Kernel | None] = []  # the kernel once loaded: read without the lock on every product


class Int8Kernel:
    def __init__(self, library: ctypes.CDLL):
        self._library = library  # kept: the functions below point into it
        i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        self._quantize = library.sd_quantize_rows
        self._quantize.argtypes = [i32, i64, i64, ptr, i64, ptr, ptr, i32]
        self._epilogue = library.sd_epilogue
        self._epilogue.argtypes = [i32, i64, i64, ptr, ptr, i64, ptr, ptr, i32]
        self._product = library.sd_w8a8_product
        self._product.argtypes = [i32, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i32]
        self._quantized_product = library.sd_w8a8_quantized_product
        self._quantized_product.argtypes = [i32, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i32]
        self._quantize16 = library.sd_w8a16_quantize_rows
        self._quantize16.argtypes = [i32, i64, i64, ptr, i64, i32, ptr, ptr, ptr, i32]
        self._product16 = library.sd_w8a16_product
        self._product16.argtypes = [i32, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr, i32]
        self._quantized_product16 = library.sd_w8a16_quantized_product
        self._quantized_product16.argtypes = [i32, i64, i64, i64, ptr, i64, i32, ptr, ptr, ptr, ptr, ptr, i32]
        functions = (self._quantize, self._epilogue, self._product, self._quantized_product)
        for function in functions + (self._quantize16, self._product16, self._quantized_product16):
            function.restype = ctypes.c_int
        library.sd_kernel_isa.restype = ctypes.c_char_p
        self.isa = library.sd_kernel_isa().decode()  # the instruction set its inner loops were built for
        # the AMX build: whether the OS handed this process the tiles (else its vpdpbusd items run)
        self.tiles = self.isa == "amx" and bool(library.sd_tiles_granted())

    @staticmethod
    def supports(x: torch.Tensor) -> bool:  # [n, in]
        return x.device.type == "cpu" and x.dtype in DTYPES and x.dim() == 2 and x.stride(1) == 1

    def quantize_rows(
        self,
        x: torch.Tensor,  # [n, in], supports(x)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # uint8 codes [n, in] (zero point 128), float32 scales [n, 1]
        n, k = x.shape
        codes = torch.empty(n, k, dtype=torch.uint8)
        scales = torch.empty(n, 1, dtype=torch.float32)
        threads = torch.get_num_threads()
        if self._quantize(
            DTYPES[x.dtype], n, k, x.data_ptr(), x.stride(0), codes.data_ptr(), scales.data_ptr(), threads
        ):
            raise ValueError(f"w8a8 quantization refused x of {x.dtype}, shape {tuple(x.shape)}")
        return codes, scales

    def epilogue(
        self,
        sums: torch.Tensor,  # [n, out] float32, contiguous
        row_scales: torch.Tensor,  # [n, 1] float32
        bias: torch.Tensor | None,  # [out] of dtype, contiguous
        dtype: torch.dtype,  # in DTYPES
    ) -> torch.Tensor:  # [n, out] of dtype: (sums * row_scales).to(dtype) + bias, bit for bit
        n, m = sums.shape
        out = torch.empty(n, m, dtype=dtype)
        bias_pointer = None if bias is None else bias.data_ptr()
        if self._epilogue(
            DTYPES[dtype], n, m, sums.data_ptr(), row_scales.data_ptr(), row_scales.stride(0), bias_pointer,
            out.data_ptr(), torch.get_num_threads(),
        ):  # fmt: skip
            raise ValueError(f"w8a8 epilogue refused sums of shape {tuple(sums.shape)} to {dtype}")
        return out

    @staticmethod
    def pack(codes: torch.Tensor) -> torch.Tensor:  # [out, in] int8 -> [groups, in / 4, GROUP, 4] int8
        """The weight codes in product()'s layout (the C file's): GROUP columns a group, then
        quads of inputs, each column's four codes together; zero codes pad the last group."""
        out, inputs = codes.shape
        groups = -(-out // GROUP)
        padded = torch.zeros(groups * GROUP, inputs, dtype=torch.int8)
        padded[:out] = codes
        return padded.view(groups, GROUP, inputs // 4, 4).transpose(1, 2).contiguous()

    @staticmethod
    def packs(shape: tuple[int, int]) -> bool:  # (out, in)
        return shape[1] % 4 == 0 and shape[1] < 2**16  # int32 sums stay exact below 2^16 inputs

    def product(
        self,
        codes: torch.Tensor,  # [n, in] uint8 contiguous, from quantize_rows
        row_scales: torch.Tensor,  # [n, 1] float32
        packed: torch.Tensor,  # pack()'s layout
        compensation: torch.Tensor,  # [out] int32: 128 x each output column's code sum
        weight_scales: torch.Tensor,  # [out] float32
        bias: torch.Tensor | None,  # [out] of dtype, contiguous
        dtype: torch.dtype,  # in DTYPES
    ) -> torch.Tensor:  # [n, out] of dtype: what oneDNN's product and epilogue() give, bit for bit
        (n, k), m = codes.shape, compensation.shape[0]
        out = torch.empty(n, m, dtype=dtype)
        bias_pointer = None if bias is None else bias.data_ptr()
        if self._product(
            DTYPES[dtype], n, k, m, codes.data_ptr(), row_scales.data_ptr(), row_scales.stride(0), packed.data_ptr(),
            compensation.data_ptr(), weight_scales.data_ptr(), bias_pointer, out.data_ptr(), torch.get_num_threads(),
        ):  # fmt: skip
            raise ValueError(f"w8a8 product refused codes of shape {tuple(codes.shape)} to {dtype}")
        return out

    def quantized_product(
        self,
        x: torch.Tensor,  # [n, in], supports(x)
        packed: torch.Tensor,  # pack()'s layout
        compensation: torch.Tensor,  # [out] int32
        weight_scales: torch.Tensor,  # [out] float32
        bias: torch.Tensor | None,  # [out] of x's dtype, contiguous
    ) -> torch.Tensor:  # [n, out] of x's dtype: product(*quantize_rows(x), ...) in one call
        (n, k), m = x.shape, compensation.shape[0]
        out = torch.empty(n, m, dtype=x.dtype)
        bias_pointer = None if bias is None else bias.data_ptr()
        if self._quantized_product(
            DTYPES[x.dtype], n, k, m, x.data_ptr(), x.stride(0), packed.data_ptr(), compensation.data_ptr(),
            weight_scales.data_ptr(), bias_pointer, out.data_ptr(), torch.get_num_threads(),
        ):  # fmt: skip
            raise ValueError(f"w8a8 product refused x of {x.dtype}, shape {tuple(x.shape)}")
        return out

    def wide_quantize_rows(
        self,
        x: torch.Tensor,  # [n, in], supports(x)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # int32 codes [n, in], float32 scales [n, 1]
        """w8a16's row quantization (the C file's): the codes recomposed from the bytes
        the product reads, code = 256 * (hi - 128) + lo."""
        n, k = x.shape
        bytes_ = torch.empty(2, n, k, dtype=torch.uint8)
        scales = torch.empty(n, 1, dtype=torch.float32)
        if self._quantize16(
            DTYPES[x.dtype], n, k, x.data_ptr(), x.stride(0), wide_activation_limit(k), bytes_[0].data_ptr(),
            bytes_[1].data_ptr(), scales.data_ptr(), torch.get_num_threads(),
        ):  # fmt: skip
            raise ValueError(f"w8a16 quantization refused x of {x.dtype}, shape {tuple(x.shape)}")
        return (bytes_[0].int() - 128) * 256 + bytes_[1].int(), scales

    def wide_product(
        self,
        codes: torch.Tensor,  # [n, in] int32 activation codes, |code| <= wide_activation_limit(in)
        row_scales: torch.Tensor,  # [n, 1] float32
        packed: torch.Tensor,  # pack()'s layout
        compensation: torch.Tensor,  # [out] int32
        weight_scales: torch.Tensor,  # [out] float32
        bias: torch.Tensor | None,  # [out] of dtype, contiguous
        dtype: torch.dtype,  # in DTYPES
    ) -> torch.Tensor:  # [n, out] of dtype
        """The w8a16 product of codes quantized elsewhere (a test's other quantization)."""
        (n, k), m = codes.shape, compensation.shape[0]
        if codes.abs().max() > wide_activation_limit(k):
            raise ValueError(f"w8a16 activation codes beyond {wide_activation_limit(k)} for {k} inputs")
        hi = ((codes >> 8) + 128).to(torch.uint8).contiguous()
        lo = (codes & 255).to(torch.uint8).contiguous()
        out = torch.empty(n, m, dtype=dtype)
        bias_pointer = None if bias is None else bias.data_ptr()
        if self._product16(
            DTYPES[dtype], n, k, m, hi.data_ptr(), lo.data_ptr(), row_scales.data_ptr(), row_scales.stride(0),
            packed.data_ptr(), compensation.data_ptr(), weight_scales.data_ptr(), bias_pointer, out.data_ptr(),
            torch.get_num_threads(),
        ):  # fmt: skip
            raise ValueError(f"w8a16 product refused codes of shape {tuple(codes.shape)} to {dtype}")
        return out

    def wide_quantized_product(
        self,
        x: torch.Tensor,  # [n, in], supports(x)
        packed: torch.Tensor,  # pack()'s layout
        compensation: torch.Tensor,  # [out] int32
        weight_scales: torch.Tensor,  # [out] float32
        bias: torch.Tensor | None,  # [out] of x's dtype, contiguous
    ) -> torch.Tensor:  # [n, out] of x's dtype: w8a16 (projection.W8A16Projection), quantizing too
        (n, k), m = x.shape, compensation.shape[0]
        out = torch.empty(n, m, dtype=x.dtype)
        bias_pointer = None if bias is None else bias.data_ptr()
        if self._quantized_product16(
            DTYPES[x.dtype], n, k, m, x.data_ptr(), x.stride(0), wide_activation_limit(k), packed.data_ptr(),
            compensation.data_ptr(), weight_scales.data_ptr(), bias_pointer, out.data_ptr(), torch.get_num_threads(),
        ):  # fmt: skip
            raise ValueError(f"w8a16 product refused x of {x.dtype}, shape {tuple(x.shape)}")
        return out

    @staticmethod
    def unpack(packed: torch.Tensor, out: int) -> torch.Tensor:  # pack()'s layout -> [out, in] int8
        groups, quads = packed.shape[:2]
        return packed.transpose(1, 2).reshape(groups * GROUP, quads * 4)[:out]

    @staticmethod
    def epilogue_supports(sums: torch.Tensor, row_scales: torch.Tensor, bias: torch.Tensor | None, dtype) -> bool:
        """Whether epilogue() takes these (else the torch expression runs)."""
        return (
            dtype in DTYPES
            and sums.dtype == torch.float32
            and sums.is_contiguous()
            and row_scales.dtype == torch.float32
            and row_scales.shape == (sums.shape[0], 1)
            and (bias is None or (bias.dtype == dtype and bias.is_contiguous() and bias.shape == (sums.shape[1],)))
        )


def wide_activation_limit(k: int) -> int:
    """w8a16's largest activation code for products of k inputs: WIDE_ACTIVATION_LIMIT, or less
    where k is large enough that the int32 sum could overflow. |sum| <= limit * 127 * k < 2^31
    keeps every sum exact (the C file's check_limit is the same bound)."""
    return min(WIDE_ACTIVATION_LIMIT, (2**31 - 1) // (WEIGHT_LIMIT * k))


def load(isa: str | None = None) -> Int8Kernel | None:
    """The kernel built for `isa` (one of cpu.runnable_kernel_isas()), by default for the one
    cpu.kernel_isa() chooses, once per process (and once per machine, source and instruction
    set); None where it cannot be built, with one warning."""
    if isa is None and _ready:
        return _ready[0]
    if isa is not None and isa not in runnable_kernel_isas():
        raise ValueError(f"this CPU does not run the {isa} build (it runs {', '.join(runnable_kernel_isas())})")
    with _lock:
        chosen = isa or kernel_isa()
        key = f"{chosen}-{native.build_key(SOURCE, chosen)}"
        if key not in _loaded:
            _loaded[key] = _load(key, chosen)
        if isa is None:
            _ready[:] = [_loaded[key]]
        return _loaded[key]


def _load(key: str, isa: str) -> Int8Kernel | None:
    try:
        kernel = Int8Kernel(native.open_library(_build(key, isa), ABI_VERSION))
        if kernel.isa != isa:  # flags that did not select the section they name
            raise OSError(f"the {isa} build of {SOURCE.name} compiled its {kernel.isa} sections")
        return kernel
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("w8a8 kernel unavailable (%s): its products run on torch operations", error)
        return None


def _build(key: str, isa: str) -> Path:  # a test replaces it with a failing build
    return native.build(SOURCE, key, isa)
