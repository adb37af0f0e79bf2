"""What this CPU can do, read once from /proc/cpuinfo (empty elsewhere): kernels are chosen at run time."""

from __future__ import annotations

import functools
import os
from pathlib import Path

# the instruction-set extensions that oneDNN, ATen and MKL choose kernels by (prefixes of cpuinfo flags)
ISA_FLAG_PREFIXES = ("sse", "ssse3", "avx", "amx", "fma", "f16c", "vnni")
# what caps or steers those choices from the environment (read once per process by the libraries)
KERNEL_ENV = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_CPU_ISA_HINTS",
    "DNNL_CPU_ISA_HINTS",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "MKL_DEBUG_CPU_TYPE",
)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return {}
    fields = {}
    for line in cpuinfo.read_text().splitlines():
        if not line.strip():
            break  # the end of the first processor
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def has_amx() -> bool:
    """Intel AMX tiles (Sapphire Rapids and later): oneDNN's half-precision products run on them."""
    return "amx_bf16" in cpu_flags()


def has_avx512() -> bool:
    """AVX-512 (AMD Zen 4 and later, most Xeons): oneDNN's float32 and bfloat16 kernels use it."""
    return "avx512f" in cpu_flags()


def kernel_choices() -> dict[str, object]:
    """What decides which kernels run, and so the bits of a result: the CPU model (kernels pick
    their blocking from its caches), its instruction-set extensions, and the environment
    variables that cap them (ONEDNN_MAX_CPU_ISA=AVX512_CORE runs bfloat16 without the native
    instructions, and rounds otherwise). Read at each call, not cached: a test changes them."""
    info = _cpuinfo()
    return {
        "cpu": [info.get(name, "") for name in ("vendor_id", "cpu family", "model", "model name")],
        "isa": sorted(flag for flag in cpu_flags() if flag.startswith(ISA_FLAG_PREFIXES)),
        "env": {name: os.environ[name] for name in KERNEL_ENV if name in os.environ},
    }
