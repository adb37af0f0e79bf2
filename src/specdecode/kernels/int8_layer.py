"""The w8a8 decoder layers in one C call a forward (csrc/int8_layer.c): built on first use
(native.py), loaded with ctypes.

Where the w8a8 product kernel runs its own product (int8_kernel.py) and the tree attention
kernel is used (tree_attention.py), FastLlamaRunner with quantization="w8a8" runs every decoder
layer of a forward here, and so does FastTransformersRunner for the architectures whose layers
follow one of the C file's recipes (`Recipe`: Qwen3's q/k norms, Gemma's norms, sandwich norms,
sliding windows and gelu): the norms, the products (the w8a8 kernel's function, by pointer),
rope, the KV-cache writes, attention (tree_attention.c, compiled into this library), the
activation and the residual sums, for every row of every sequence of the forward. It replaces
~35 torch operations a layer, each costing microseconds of dispatch.

Each row's result depends on that row and on the keys it sees, never on the other rows (the C
file states the arithmetic), so tokens keep the same bits alone, verified in a chain or a tree,
or among other sequences' rows. The rms norm's sum and silu's exp are the C file's, not torch's:
these are other bits than the torch path's (close: the same model), so the runner runs every
forward of such a model here, prefills too, and `kernel_identity()` goes into the response
cache's fingerprint. It is built for the product kernel's instruction set (cpu.kernel_isa), and
gives the same bits on each (tests/kernels/test_int8_layer.py). Without gcc, or if the build
fails, `load()` returns None (one warning) and the layers run on torch operations.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.kernels import int8_kernel, native, tree_attention

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "int8_layer.c"
ABI_VERSION = 2
DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_loaded: dict[str, Int8Layers | None] = {}

_i32, _i64, _f32, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Product(ctypes.Structure):  # the C file's LayerProduct
    _fields_ = [
        ("packed", _ptr),
        ("compensation", _ptr),
        ("scales", _ptr),
        ("bias", _ptr),
        ("out", _i64),
        ("in_", _i64),
    ]


NORMS = ("rounded", "plus-one")  # the C file's NORM_ROUNDED (Llama), NORM_PLUS_ONE (Gemma)
ACTIVATIONS = ("silu", "gelu-tanh")
NORM_NAMES = ("attn_norm", "mlp_norm", "attn_out_norm", "mlp_out_norm", "q_norm", "k_norm")


@dataclass(frozen=True)
class Recipe:
    """How a model's layers compute what the C file's header leaves open."""

    norm: str = "rounded"
    activation: str = "silu"
    scale: float | None = None  # attention's score scale; None: head_dim ** -0.5
    softcap: float = 0.0  # 0, or attention scores soft-capped at it


@dataclass
class Layer:
    """One layer's weights as the C decoder takes them (the Llama runner's layers have the same
    names): norms of the model's dtype ([hidden]; q/k norms [head_dim]), Int8Projections."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: object
    o: object
    gate_up: object
    down: object
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    window: int = 0  # 0: every earlier key; else the sliding window
    rope: int = 0  # the index of its cos and sin tables among a forward's


class _Weights(ctypes.Structure):  # LayerWeights
    _fields_ = [(n, _ptr) for n in NORM_NAMES] + [("window", _i32), ("rope", _i32)]
    _fields_ += [(n, _Product) for n in ("qkv", "o", "gate_up", "down")]


class _Forward(ctypes.Structure):  # Forward
    _fields_ = [
        (n, _i32)
        for n in ("dtype", "layers", "heads", "kv_heads", "d", "hidden", "intermediate", "threads", "sequences")
    ]
    _fields_ += [("norm", _i32), ("activation", _i32), ("eps", _f32), ("scale", _f32), ("softcap", _f32)]
    _fields_ += [("rows", _i64), ("product", _ptr), ("weights", _ptr)]
    _fields_ += [(n, _ptr) for n in ("cos", "sin", "starts", "counts", "lengths", "capacities")]
    _fields_ += [(n, _ptr) for n in ("contiguous", "extra", "max_extra", "positions")]
    _fields_ += [(n, _ptr) for n in ("keys", "values", "kept", "keep_slot")]


def kernel_identity() -> str:
    """What the response cache fingerprints: the bits are this source's and the kernels' it calls."""
    parts = [native.source_hash(s) for s in (SOURCE, tree_attention.SOURCE, int8_kernel.SOURCE)]
    return f"int8-layer:{hashlib.sha256(' '.join(parts).encode()).hexdigest()[:16]}"


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Int8Layers:
    """The decoder layers of one runner: its weights' pointers fixed once (`bind`), then one call
    a forward."""

    def __init__(self, library: ctypes.CDLL, product: int, isa: str):
        self._library = library  # kept: the function below points into it
        self.isa = isa  # the instruction set of this library and of the product it calls
        self._call = library.sd_int8_decoder
        self._call.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._call.restype = ctypes.c_int
        self._product = product  # the address of int8_kernel's sd_w8a8_quantized_product

    def bind(
        self, layers: list, dtype: torch.dtype, heads: int, kv_heads: int, d: int, eps: float, recipe: Recipe = Recipe()
    ) -> BoundLayers:
        """layers: per layer, an object with `Layer`'s fields (those after `down` optional)."""
        if recipe.norm not in NORMS or recipe.activation not in ACTIVATIONS:
            raise ValueError(f"no C recipe for {recipe.norm} norms and {recipe.activation}")
        weights = (_Weights * len(layers))()
        # copies of what may be the model's own parameters (norms, biases): release_model_weights
        # moves those, and the pointers here must stay valid (a few KB)
        owned: list[torch.Tensor | None] = []
        for w, layer in zip(weights, layers):
            for name in NORM_NAMES:
                norm = getattr(layer, name, None)
                norm = None if norm is None else norm.detach().to(dtype).contiguous().clone()
                owned.append(norm)
                setattr(w, name, _pointer(norm))
            if (w.q_norm is None) != (w.k_norm is None):
                raise ValueError("a layer has both q and k norms or neither")
            w.window, w.rope = int(getattr(layer, "window", 0)), int(getattr(layer, "rope", 0))
            for name in ("qkv", "o", "gate_up", "down"):
                p = getattr(layer, name)
                bias = None if p.bias is None else p.bias.detach().clone()
                owned.append(bias)
                setattr(w, name, _Product(p.weight.data_ptr(), p.compensation.data_ptr(), p.scales.data_ptr(),
                                          _pointer(bias), p.shape[0], p.shape[1]))  # fmt: skip
        hidden = layers[0].o.shape[0]
        intermediate = layers[0].down.shape[1]
        shape = (dtype, heads, kv_heads, d, hidden, intermediate, eps)
        return BoundLayers(self, weights, (layers, owned), shape, recipe)


class BoundLayers:
    def __init__(self, kernel, weights, layers, shape, recipe: Recipe):
        self._kernel, self._weights, self._tensors = kernel, weights, layers  # keeps the tensors alive
        self.layers = len(layers[0])
        self.dtype, self.heads, self.kv_heads, self.d, self.hidden, self.intermediate, self.eps = shape
        self.recipe = recipe
        self.windowed = any(w.window for w in weights)

    def __call__(
        self,
        x: torch.Tensor,  # [rows, hidden] contiguous, the embeddings: overwritten with the last layer's output
        cos: list[torch.Tensor],  # per rope table: [rows, d] contiguous
        sin: list[torch.Tensor],  # per rope table: [rows, d] contiguous
        caches: list,  # StaticKVCache per sequence, reserved for its new rows
        sizes: list[int],
        plans: list,  # per sequence: (contiguous [n] int32, extra [n, E] int32), the tree attention kernel's plan
        keep: tuple[int, ...] = (),  # layer indices whose input to return (len(layers): the output)
        positions: list[torch.Tensor] | None = None,  # per sequence: [n] logical positions (sliding windows)
    ) -> dict[int, torch.Tensor]:
        layers, sequences, rows = self.layers, len(caches), x.shape[0]
        if self.windowed and positions is None:
            raise ValueError("layers with a sliding window need each row's position")
        starts = [0]
        for n in sizes[:-1]:
            starts.append(starts[-1] + n)
        i64s = [torch.tensor(v, dtype=torch.int64) for v in (starts, sizes, [c.length for c in caches])]
        i64s.append(torch.tensor([c.capacity for c in caches], dtype=torch.int64))
        plans = [(c.contiguous(), e.contiguous()) for c, e in plans]
        contiguous = _pointers([c for c, _ in plans])
        extra = _pointers([e for _, e in plans])
        where = [p.to(torch.int32).contiguous() for p in positions] if positions is not None else []
        positions_at = _pointers(where) if positions is not None else None
        max_extra = torch.tensor([e.shape[1] for _, e in plans], dtype=torch.int32)
        keys = _pointers([k for c in caches for k in c.keys])
        values = _pointers([v for c in caches for v in c.values])
        tables = _pointers(cos), _pointers(sin)
        kept = torch.empty(len(keep), rows, self.hidden, dtype=x.dtype) if keep else None
        slots = torch.full((layers + 1,), -1, dtype=torch.int32)
        for slot, layer in enumerate(keep):
            slots[layer] = slot
        r = self.recipe
        scale = r.scale if r.scale is not None else self.d**-0.5
        forward = _Forward(
            DTYPES[self.dtype], layers, self.heads, self.kv_heads, self.d, self.hidden, self.intermediate,
            torch.get_num_threads(), sequences, NORMS.index(r.norm), ACTIVATIONS.index(r.activation), self.eps,
            scale, r.softcap, rows, self._kernel._product, ctypes.addressof(self._weights),
            *[ctypes.addressof(t) for t in tables], *[t.data_ptr() for t in i64s],
            ctypes.addressof(contiguous), ctypes.addressof(extra), max_extra.data_ptr(),
            None if positions_at is None else ctypes.addressof(positions_at), ctypes.addressof(keys),
            ctypes.addressof(values), _pointer(kept), slots.data_ptr(),
        )  # fmt: skip
        status = self._kernel._call(ctypes.byref(forward), x.data_ptr())
        if status:
            raise ValueError(f"the int8 decoder layers refused their arguments (status {status})")
        return {} if kept is None else {layer: kept[slot] for slot, layer in enumerate(keep)}


def _pointers(tensors: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


def load() -> Int8Layers | None:
    """The decoder, built for the w8a8 kernel's instruction set once per process (and once per
    machine, sources and instruction set); None where it or the w8a8 kernel it calls cannot be
    built, with one warning."""
    with _lock:
        product_kernel = int8_kernel.load()
        if product_kernel is None:
            return None
        isa = product_kernel.isa
        key = f"{isa}-{native.build_key(SOURCE, isa)}"  # the included sources are in the key
        if key not in _loaded:
            _loaded[key] = _load(key, isa, product_kernel)
        return _loaded[key]


def _load(key: str, isa: str, product_kernel: int8_kernel.Int8Kernel) -> Int8Layers | None:
    try:
        library = native.open_library(_build(key, isa), ABI_VERSION)
        product = ctypes.cast(product_kernel._quantized_product, ctypes.c_void_p).value
        return Int8Layers(library, product, isa)
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("int8 decoder layer kernel unavailable (%s): the w8a8 layers run on torch operations", error)
        return None


def _build(key: str, isa: str) -> Path:  # a test replaces it with a failing build
    return native.build(SOURCE, key, isa)
