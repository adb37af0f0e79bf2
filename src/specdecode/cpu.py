"""What this CPU can do, read once from /proc/cpuinfo (empty elsewhere): kernels are chosen at run time."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def has_amx() -> bool:
    """Intel AMX tiles (Sapphire Rapids and later): oneDNN's half-precision products run on them."""
    return "amx_bf16" in cpu_flags()


def has_avx512() -> bool:
    """AVX-512 (AMD Zen 4 and later, most Xeons): oneDNN's float32 and bfloat16 kernels use it."""
    return "avx512f" in cpu_flags()
