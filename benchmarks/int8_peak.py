"""How close the w8a8 products come to this CPU's integer peak, and what that peak allows.

The w8a8 fast path's products are sums of u8 x s8 quads on AVX512-VNNI (`vpdpbusd`: 64
multiply-adds per instruction). A forward over n new tokens runs, per token, the decoder layers'
products (their multiply-adds / 64 instructions) and the w8a16 output head's (twice: two byte
halves per activation). This script measures
1. the peak: a loop of independent `vpdpbusd` on registers (no memory), on 1 and on 2 threads;
2. the default model's products, as the forward runs them (the four products of a layer, the
   head), at 1 to 32 rows, weights warm in cache, with the instructions per second they reach;
3. the compute floor of a forward over n tokens: n x instructions per token / the 2-thread peak.

    .venv/bin/python benchmarks/int8_peak.py [--out FILE]
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specdecode.bench.scripts import script_parser, write_table
from specdecode.cpu import runnable_kernel_isas
from specdecode.kernels import int8_kernel
from specdecode.runners.projection import int8_projection, w8a16_projection

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define DECLARE(j) __m512i a##j = _mm512_setzero_si512();
#define STEP(j) a##j = _mm512_dpbusd_epi32(a##j, x, w);
#define SUM(j) sum = _mm512_add_epi32(sum, a##j);
int sink;
/* instructions per second of `threads` threads, each 12 independent vpdpbusd chains in registers */
double peak(long iterations, int threads) {
    double start = omp_get_wtime();
#pragma omp parallel num_threads(threads)
    {
        __m512i x = _mm512_set1_epi32(0x01010101), w = _mm512_set1_epi32(0x01020304), sum = _mm512_setzero_si512();
        CHAINS(DECLARE)
        for (long i = 0; i < iterations; i++) {
            CHAINS(STEP)
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
                             "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
        }
        CHAINS(SUM)
        sink = _mm512_reduce_add_epi32(sum); /* kept: the loop is not dead code */
    }
    return 12.0 * iterations * threads / (omp_get_wtime() - start);
}
"""
# the default model's shapes (SmolLM2-135M): a layer's products (out, in) and the output head
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS, HEAD = 30, (49152, 576)
ROWS = (1, 2, 4, 8, 16, 32)


def peak_rates() -> dict[int, float]:
    with tempfile.TemporaryDirectory() as folder:
        library = Path(folder) / "peak.so"
        command = ["gcc", "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", "-x", "c", "-", "-o", str(library)]
        subprocess.run(command, input=PEAK_SOURCE, text=True, check=True)
        peak = ctypes.CDLL(str(library)).peak
        peak.restype, peak.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int]
        return {threads: max(peak(50_000_000, threads) for _ in range(3)) for threads in (1, 2)}


def median_seconds(run, repeats: int = 50) -> float:
    for _ in range(5):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def layer_products(kernel, layer: dict, inputs: dict) -> None:
    for name, p in layer.items():
        kernel.quantized_product(inputs[name], p.weight, p.compensation, p.scales, None)


def instructions_per_token() -> tuple[int, int]:
    layer = LAYERS * sum(out * inputs for out, inputs in LAYER.values()) // 64
    return layer, 2 * HEAD[0] * HEAD[1] // 64


def run(args) -> str:
    if "avx512-vnni" not in runnable_kernel_isas() or int8_kernel.load("avx512-vnni") is None:
        return "This CPU runs no AVX512-VNNI kernel: nothing to measure.\n"
    kernel = int8_kernel.load("avx512-vnni")  # vpdpbusd's products, on an AMX CPU too
    peaks = peak_rates()
    layer = {name: int8_projection(torch.randn(*shape) * 0.02, None) for name, shape in LAYER.items()}
    head = w8a16_projection(torch.randn(*HEAD) * 0.02, None)
    per_layer, per_head = instructions_per_token()
    lines = [
        f"Peak `vpdpbusd` (registers only): {peaks[1] / 1e9:.2f} G/s on 1 thread, {peaks[2] / 1e9:.2f} G/s on 2.",
        f"Per token: {per_layer / 1e6:.2f}M instructions in the {LAYERS} layers' products, "
        f"{per_head / 1e6:.2f}M in the w8a16 head.",
        "",
        "| rows | 30 layers' products ms | G/s | head ms | G/s | both ms | compute floor ms (2-thread peak) |",
        "|---|---|---|---|---|---|---|",
    ]
    for rows in ROWS:
        inputs = {name: torch.randn(rows, shape[1]).bfloat16() for name, shape in LAYER.items()}
        x = torch.randn(rows, HEAD[1]).bfloat16()

        layers_s = LAYERS * median_seconds(lambda inputs=inputs: layer_products(kernel, layer, inputs))
        head_s = median_seconds(
            lambda x=x: kernel.wide_quantized_product(x, head.weight, head.compensation, head.scales, None)
        )
        floor = rows * (per_layer + per_head) / peaks[2]
        lines.append(
            f"| {rows} | {layers_s * 1e3:.2f} | {rows * per_layer / layers_s / 1e9:.2f} | {head_s * 1e3:.2f} | "
            f"{rows * per_head / head_s / 1e9:.2f} | {(layers_s + head_s) * 1e3:.2f} | {floor * 1e3:.2f} |"
        )
    lines += [
        "",
        f"{torch.get_num_threads()} torch threads; weights warm in cache (a forward streams them from memory).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = script_parser(__doc__)
    args = parser.parse_args()
    write_table(run(args), args.out)


if __name__ == "__main__":
    main()
