"""The tree attention kernel (csrc/tree_attention.c): built on first use, loaded with ctypes.

A query's output from it is a deterministic function of the logical sequence of keys and
values it sees, never of where they sit in the cache, of the other queries in the call or of
their count (the C file states the arithmetic). So one call per layer gives every query of a
sequence, decoded alone, verified in a chain or in a tree, the same bits: a tree node whose
ancestors sit at other cache slots gets what decoding its path alone gets.

The shared library is compiled with gcc for this CPU (-march=native) into a per-user cache
directory, named by a hash of the source, the compiler, its flags and the CPU's flags, so that
a binary built for one CPU never runs on another sharing the disk. Without gcc, or if the
build fails, `load()` returns None (one warning in the log) and the runners keep SDPA, one query
at a time. `make setup` builds it ahead, so that parallel tests do not all build it at once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from specdecode.cpu import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "tree_attention.c"
# no FMA contraction, no reassociation: the C expressions are the arithmetic (see the source)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
# threads from torch's own OpenMP runtime (GNU libgomp: the kernel's libgomp.so.1 resolves to the
# copy torch loaded, so both share one pool of threads); a thread count never changes a bit
OPENMP_FLAGS = ("-fopenmp",)
ABI_VERSION = 3
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 256  # the C file's MAX_DIM

_lock = threading.Lock()
_loaded: dict[str, TreeAttention | None] = {}


@functools.cache
def source_hash() -> str:
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def kernel_identity() -> str:
    """What the response cache fingerprints: answers from another kernel are other bits."""
    return f"tree-attention:{source_hash()}"


class _Args(ctypes.Structure):  # the C file's Args
    _fields_ = [(name, ctypes.c_int32) for name in ("dtype", "heads", "kv_heads", "n", "d", "max_extra", "threads")]
    _fields_ += [("scale", ctypes.c_float)]
    _fields_ += [
        (name, ctypes.c_int64)
        for name in ("q_head_stride", "q_row_stride", "kv_head_stride", "out_head_stride", "out_row_stride")
    ]
    _fields_ += [("contiguous", ctypes.c_void_p), ("extra", ctypes.c_void_p)]


class TreeAttention:
    """One layer of one sequence per call: every query head of every query."""

    def __init__(self, library: ctypes.CDLL):
        self._library = library  # kept: the function below points into it
        self._call = library.sd_tree_attention
        self._call.argtypes = [ctypes.c_void_p] * 5
        self._call.restype = ctypes.c_int

    def bind(
        self,
        dtype: torch.dtype,
        heads: int,
        kv_heads: int,
        head_dim: int,
        q_strides: tuple[int, int],  # q [heads, n, d]: elements between heads, between queries
        capacity: int,  # positions of the cache tensors [kv_heads, capacity, d]
        out_strides: tuple[int, int],  # out [heads, n, d]
        contiguous: torch.Tensor,  # [n] int32: query i sees cache positions 0 .. contiguous[i] - 1
        extra: torch.Tensor,  # [n, E] int32: then these cache positions, in order, until a -1
        scale: float,
    ):
        """The call for one forward of one sequence, all but its tensors fixed: a function of the
        data pointers of q, keys, values and out, and of q's strides where they change
        (contiguous and extra must outlive it)."""
        args = _Args(
            DTYPES[dtype],
            heads,
            kv_heads,
            contiguous.shape[0],
            head_dim,
            extra.shape[1],
            torch.get_num_threads(),
            scale,
            *q_strides,
            capacity * head_dim,
            *out_strides,
            contiguous.data_ptr(),
            extra.data_ptr(),
        )
        pointer, call = ctypes.addressof(args), self._call

        def attend(q: int, keys: int, values: int, out: int, q_strides: tuple[int, int] | None = None) -> None:
            if q_strides is not None and q_strides != (args.q_head_stride, args.q_row_stride):
                args.q_head_stride, args.q_row_stride = q_strides
            if call(pointer, q, keys, values, out) != 0:
                raise ValueError(f"tree attention refused its arguments ({_describe(args)})")

        attend.args = args  # keeps the arguments alive as long as the function
        return attend

    def __call__(
        self,
        q: torch.Tensor,  # [heads, n, d], d contiguous
        keys: torch.Tensor,  # [kv_heads, capacity, d] contiguous, one layer's cache
        values: torch.Tensor,  # [kv_heads, capacity, d] contiguous
        contiguous: torch.Tensor,  # [n] int32
        extra: torch.Tensor,  # [n, E] int32
        scale: float,
        out: torch.Tensor,  # [heads, n, d] of q's dtype, d contiguous: written
    ) -> None:
        heads, _, d = q.shape
        kv_heads, capacity, _ = keys.shape
        strides = (q.stride(0), q.stride(1)), (out.stride(0), out.stride(1))
        attend = self.bind(q.dtype, heads, kv_heads, d, strides[0], capacity, strides[1], contiguous, extra, scale)
        attend(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr())


def _describe(args: _Args) -> str:
    return ", ".join(f"{name}={getattr(args, name)}" for name, _ in args._fields_)


def supports(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    return device.type == "cpu" and dtype in DTYPES and head_dim <= MAX_HEAD_DIM


def load() -> TreeAttention | None:
    """The kernel, built for this CPU once per process (and once per machine and source); None
    where it cannot be built, with one warning."""
    with _lock:
        key = _build_key()
        if key not in _loaded:
            _loaded[key] = _load(key)
        return _loaded[key]


@functools.cache
def _build_key() -> str:
    """The source as this process first read it, with what compiles it and the CPU it runs on."""
    compiler = shutil.which("gcc")
    parts = [SOURCE.read_bytes().hex(), " ".join(_flags()), " ".join(sorted(cpu_flags())), str(compiler)]
    if compiler is not None:
        parts.append(_compiler_version(compiler))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _flags() -> tuple[str, ...]:
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


def _load(key: str) -> TreeAttention | None:
    try:
        path = _build(key)
        library = ctypes.CDLL(str(path))
        if library.sd_abi_version() != ABI_VERSION:
            raise OSError(f"{path} is not ABI version {ABI_VERSION}")
        if len(_libgomp_files()) > 1:
            raise OSError(f"loading {path} brought a second OpenMP runtime beside torch's")
        return TreeAttention(library)
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("tree attention kernel unavailable (%s): attention runs one query at a time", error)
        return None


def _libgomp_files() -> set[str]:
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[-1] for line in maps if "libgomp" in line}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "specdecode"


def _build(key: str) -> Path:
    target = cache_dir() / f"tree_attention-{key}.so"
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
            [compiler, *_flags(), "-o", partial, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise RuntimeError(f"gcc failed: {result.stderr.strip()[:500]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target
