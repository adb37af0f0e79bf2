"""What each C kernel is compiled from and with: the one definition that native.py (a build on
first use, for this CPU) and setup.py (the builds a wheel carries, for any CPU of its
architecture) both read. Standard library only: setup.py loads this file by its path, before the
package's dependencies exist.

A wheel carries every source built once for each instruction set of cpu.KERNEL_ISAS, with flags
that name exactly the extensions cpu.KERNEL_ISAS requires of a CPU (never -march=native: the
wheel runs on other CPUs than the one that built it). Each file's name holds its sources' hash,
so a library from other sources is never loaded. Every build gives the same bits (the C files
say why), so which one runs changes speed only.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# the kernels' sources; int8_layer.c includes the other two
SOURCES = ("tree_attention.c", "w8a8.c", "int8_layer.c")
# where an installed wheel keeps its libraries, beside this file
PREBUILT = Path(__file__).with_name("prebuilt")

# no FMA contraction, no reassociation: the C expressions are the arithmetic (see the sources)
FLAGS = ("-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
# threads from torch's own OpenMP runtime (GNU libgomp: a kernel's libgomp.so.1 resolves to the
# copy torch loaded, so both share one pool of threads); a thread count never changes a bit
OPENMP_FLAGS = ("-fopenmp",)

# a build on first use targets the CPU it runs on: "native" every instruction this CPU has (the
# tree attention kernel); the int8 kernels' builds (cpu.KERNEL_ISAS) select their C sections by
# these flags
ISA_FLAGS = {
    "native": ("-march=native",),
    "amx": ("-march=native",),  # chosen only where the CPU has AMX-INT8 (and AVX512-VNNI)
    "avx512-vnni": ("-march=native", "-DSD_NO_AMX"),  # chosen only where the CPU has AVX512-VNNI
    # the same instructions on every AVX2 CPU, and none of AVX-512's on CPUs that have it
    "avx2": ("-march=x86-64-v3",),
    "portable": ("-march=native", "-DSD_PORTABLE"),  # the plain C sections, vectorized by gcc
}
# a wheel's builds on x86-64: x86-64-v3 is cpu.KERNEL_ISAS' "avx2" set, and the AVX-512 build adds
# only the four extensions that set requires (not x86-64-v4's CD and DQ)
WHEEL_ISA_FLAGS = {
    "amx": ("-march=x86-64-v3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"),
    "avx512-vnni": ("-march=x86-64-v3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx2": ("-march=x86-64-v3",),
    "portable": ("-march=x86-64", "-DSD_PORTABLE"),
}


@functools.cache
def sources(source: Path) -> tuple[Path, ...]:
    """The source and the files it includes from its folder (`#include "name"`), recursively:
    what its library is compiled from."""
    found = [source]
    for line in source.read_text().splitlines():
        match = re.match(r'\s*#\s*include\s+"([^"]+)"', line)
        if match and (source.parent / match.group(1)).exists():
            found += [path for path in sources(source.parent / match.group(1)) if path not in found]
    return tuple(found)


def source_bytes(source: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sources(source))


@functools.cache
def source_hash(source: Path) -> str:
    return hashlib.sha256(source_bytes(source)).hexdigest()[:16]


def compile_flags(isa_flags: tuple[str, ...], openmp: bool) -> tuple[str, ...]:
    return ("-O3", *isa_flags, *FLAGS) + (OPENMP_FLAGS if openmp else ())


def compile_command(compiler: str, source: Path, output: str, flags: tuple[str, ...]) -> list[str]:
    return [compiler, *flags, "-o", output, str(source), "-lm"]


def prebuilt_name(source: Path, isa: str) -> str:
    """A wheel's library of `source` for one of cpu.KERNEL_ISAS, named by its sources' hash."""
    return f"{source.stem}-{isa}-{source_hash(source)}.so"


def wheel_builds(machine: str) -> dict[str, tuple[str, ...]]:
    """The instruction sets a wheel for `machine` (platform.machine()) carries, with their flags:
    on x86-64 each of cpu.KERNEL_ISAS; elsewhere the portable C sections, for the compiler's
    default target of that architecture."""
    if machine.lower() in ("x86_64", "amd64"):
        return WHEEL_ISA_FLAGS
    return {"portable": ("-DSD_PORTABLE",)}
