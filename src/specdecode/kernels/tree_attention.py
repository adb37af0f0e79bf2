"""The tree attention kernel (csrc/tree_attention.c): built on first use, loaded with ctypes.

A query's output from it is a deterministic function of the logical sequence of keys and
values it sees, never of where they sit in the cache, of the other queries in the call or of
their count (the C file states the arithmetic). So one call per layer gives every query of a
sequence, decoded alone, verified in a chain or in a tree, the same bits: a tree node whose
ancestors sit at other cache slots gets what decoding its path alone gets.

The shared library is compiled with gcc for this CPU (native.py: a per-user cache directory,
named by a hash of the source, the compiler, its flags and the CPU's flags). Without gcc, or if the
build fails, `load()` returns None (one warning in the log) and the runners keep SDPA, one query
at a time. `make setup` builds it ahead, so that parallel tests do not all build it at once.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from pathlib import Path

import torch

from specdecode.kernels import native

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "tree_attention.c"
ABI_VERSION = 4
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 256  # the C file's MAX_DIM

_lock = threading.Lock()
_loaded: dict[str, TreeAttention | None] = {}


def kernel_identity() -> str:
    """What the response cache fingerprints: answers from another kernel are other bits."""
    return f"tree-attention:{native.source_hash(SOURCE)}"


class _Args(ctypes.Structure):  # the C file's Args
    _fields_ = [(name, ctypes.c_int32) for name in ("dtype", "heads", "kv_heads", "n", "d", "max_extra", "threads")]
    _fields_ += [("scale", ctypes.c_float)]
    _fields_ += [
        (name, ctypes.c_int64)
        for name in ("q_head_stride", "q_row_stride", "kv_head_stride", "out_head_stride", "out_row_stride")
    ]
    _fields_ += [("contiguous", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("first", ctypes.c_void_p)]
    _fields_ += [("softcap", ctypes.c_float)]


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
        first: torch.Tensor | None = None,  # [n] int32: query i's first cache position (a sliding window)
        softcap: float = 0.0,  # tanh soft-capping of the scaled scores (0: none)
    ):
        """The call for one forward of one sequence, all but its tensors fixed: a function of the
        data pointers of q, keys, values and out, and of q's strides where they change
        (contiguous, extra and first must outlive it)."""
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
            None if first is None else first.data_ptr(),
            softcap,
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


def tree_plan(
    length: int, parents: torch.Tensor, n: int, num_logits: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's plan for a tree of n new tokens (parents [n]) after `length` cached ones:
    (logical positions [n], contiguous [n] int32: every token sees cache positions 0 .. length - 1,
    extra [n, depth] int32: then the slots of its ancestors and itself, until a -1)."""
    if num_logits != n or parents.shape != (n,):
        raise ValueError(f"a tree of {n} tokens wants all {n} rows' logits and {n} parents")
    paths: list[list[int]] = []  # the cache slots each token sees after the cached prefix
    for i, parent in enumerate(parents.tolist()):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a parent comes before its child, or is -1")
        paths.append((paths[parent] if parent >= 0 else []) + [length + i])
    width = max(len(path) for path in paths)
    extra = torch.tensor([path + [-1] * (width - len(path)) for path in paths], dtype=torch.int32)
    positions = torch.tensor([length + len(path) - 1 for path in paths])
    return positions, torch.full((n,), length, dtype=torch.int32), extra


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


def _build_key() -> str:
    return native.build_key(SOURCE)


def _load(key: str) -> TreeAttention | None:
    try:
        return TreeAttention(native.open_library(_build(key), ABI_VERSION))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("tree attention kernel unavailable (%s): attention runs one query at a time", error)
        return None


def _build(key: str) -> Path:  # a test replaces it with a failing build
    return native.build(SOURCE, key)
