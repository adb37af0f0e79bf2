"""What this CPU can do, read once from /proc/cpuinfo (empty elsewhere): kernels are chosen at run time."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

log = logging.getLogger(__name__)

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


# The builds of this package's int8 kernels (kernels/csrc/w8a8.c, int8_layer.c), fastest first, with
# the cpuinfo flags each needs: AMX (AVX512-VNNI's with tile multiplies for products of many rows),
# AVX512-VNNI (compiled for this CPU), AVX2 (compiled for x86-64-v3:
# AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE and what v2 has) and portable C (any CPU). Every build
# writes the same bits (integer sums, then the same float32 operations in the same order).
KERNEL_ISAS = {
    "amx": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"}),
    "avx512-vnni": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avx2": frozenset(
        {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave"}
        | {"cx16", "lahf_lm", "popcnt", "pni", "ssse3", "sse4_1", "sse4_2"}
    ),
    "portable": frozenset(),
}
# forces one of KERNEL_ISAS that this CPU runs (the tests run the AVX2 build on AVX-512 CPUs)
KERNEL_ISA_VARIABLE = "SPECDECODE_KERNEL_ISA"


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


def runnable_kernel_isas() -> tuple[str, ...]:
    """The builds of the int8 kernels this CPU runs, fastest first (portable always); the AMX
    build only where the OS hands this process the tiles."""
    flags = cpu_flags()
    return tuple(isa for isa, needs in KERNEL_ISAS.items() if needs <= flags and (isa != "amx" or amx_tiles_granted()))


def amx_tiles_granted() -> bool:
    """Whether Linux hands this process AMX's tile state, which a process must ask for before its
    first tile instruction (a kernel without that request, before Linux 5.16, never does)."""
    return {"amx_tile", "amx_int8"} <= cpu_flags() and _request_tiles()


@functools.cache
def _request_tiles() -> bool:  # once per process: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).syscall(158, 0x1023, 18) == 0  # 158: SYS_arch_prctl
    except (OSError, AttributeError):
        return False


def kernel_isa() -> str:
    """Which build of the int8 kernels runs: the one SPECDECODE_KERNEL_ISA names where this CPU
    runs it, else the fastest this CPU runs. The one place that chooses (int8_kernel.load asks it
    once per process; the response cache's fingerprint names it)."""
    runnable = runnable_kernel_isas()
    forced = os.environ.get(KERNEL_ISA_VARIABLE, "").strip().lower()
    if forced in runnable:
        return forced
    if forced:
        _refuse(forced, runnable)
    return runnable[0]


def kernel_isa_forced() -> bool:
    """Whether SPECDECODE_KERNEL_ISA names a build this CPU runs (kernel_isa then picks it)."""
    return os.environ.get(KERNEL_ISA_VARIABLE, "").strip().lower() in runnable_kernel_isas()


@functools.cache
def _refuse(forced: str, runnable: tuple[str, ...]) -> None:  # once per value
    log.warning(
        "%s=%s ignored: this CPU runs %s (an unknown name, or a build for instructions it lacks)",
        KERNEL_ISA_VARIABLE, forced, ", ".join(runnable),
    )  # fmt: skip


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
