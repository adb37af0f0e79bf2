"""The C kernels' build and load (csrc/*.c): compiled on first use, loaded with ctypes.

A shared library is compiled with gcc for this CPU (-march=native) into a per-user cache
directory, named by a hash of the source, the compiler, its flags and the CPU's flags, so that
a binary built for one CPU never runs on another sharing the disk. The kernels' modules
(tree_attention.py, int8_kernel.py) turn a failure into one warning and their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specdecode.cpu import cpu_flags

CSRC = Path(__file__).with_name("csrc")
# no FMA contraction, no reassociation: the C expressions are the arithmetic (see the sources)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
# threads from torch's own OpenMP runtime (GNU libgomp: a kernel's libgomp.so.1 resolves to the
# copy torch loaded, so both share one pool of threads); a thread count never changes a bit
OPENMP_FLAGS = ("-fopenmp",)


@functools.cache
def source_hash(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


@functools.cache
def build_key(source: Path) -> str:
    """The source as this process first read it, with what compiles it and the CPU it runs on."""
    compiler = shutil.which("gcc")
    parts = [source.read_bytes().hex(), " ".join(flags()), " ".join(sorted(cpu_flags())), str(compiler)]
    if compiler is not None:
        parts.append(_compiler_version(compiler))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def flags() -> tuple[str, ...]:
    return FLAGS + (OPENMP_FLAGS if _torch_runs_libgomp() else ())


def _torch_runs_libgomp() -> bool:
    """Whether torch parallelises with GNU OpenMP and has loaded its libgomp (another runtime,
    such as Intel's, would start a second pool of threads beside torch's)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        return "libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def open_library(path: Path, abi_version: int) -> ctypes.CDLL:
    """Loads a built library; OSError if it is another ABI or brought a second OpenMP runtime."""
    library = ctypes.CDLL(str(path))
    if library.sd_abi_version() != abi_version:
        raise OSError(f"{path} is not ABI version {abi_version}")
    if len(_libgomp_files()) > 1:
        raise OSError(f"loading {path} brought a second OpenMP runtime beside torch's")
    return library


def _libgomp_files() -> set[str]:
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if "libgomp" in line}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"


def build(source: Path, key: str) -> Path:
    """The shared library of a source for this key, compiled unless the cache holds it."""
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    compiler = shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no gcc on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    # built beside its final name and renamed: another process never loads a half-written file
    fd, partial = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.partial", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags(), "-o", partial, str(source), "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise RuntimeError(f"gcc failed: {result.stderr.strip()[:500]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target
