"""A lean forward pass for Llama-family models (Llama, SmolLM2, Mistral, Qwen2).

Same weights and the same arithmetic as transformers' modeling, without its per-call
machinery, and shaped for speculative decoding:
- a static KV cache (static_cache.StaticKVCache): rollback moves a length, copies nothing;
- fused projections (q|k|v, gate|up): fewer, larger matrix products, each weight kept once,
  in the layout oneDNN wants (projection.py), or as weight-only int8;
- logits only for the positions the caller asks for;
- on the CPU, decoding and verification (chains and trees) attend through one kernel
  (tree_attention.py) whose result for a query depends only on the keys it sees, so that a
  token's logits are bitwise the same whether it is verified among others, in a tree, or
  decoded alone (see FastLlamaRunner).

It implements `runners.base.ModelRunner`; `supports(model)` says when it applies. Outputs
match transformers' to float rounding (tests/runners/test_fast_runners.py states the tolerance).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdecode import precision
from specdecode.kernels import int8_layer, tree_attention
from specdecode.runners import projection as projections
from specdecode.runners import smoothing
from specdecode.runners.attention import attend, per_query_by_default
from specdecode.runners.projection import (
    CodedEmbedding,
    Int8Projection,
    Projection,
    W8A16Projection,
    coded_embedding,
    has_vnni,
    int8_projection,
    int8_supported,
    projection,
    w8a16_projection,
)
from specdecode.runners.static_cache import KeepsHiddenStates, StaticCacheRunner, StaticKVCache, append

logger = logging.getLogger(__name__)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
PRODUCTS = ("qkv", "o", "gate_up", "down", "head")  # a layer's products, and the output head
CALIBRATION_TOKENS = 512  # the default smoothing calibration's length
INITIAL_CAPACITY = 1024  # cache positions allocated up front; doubled when a sequence needs more


def supports(model: PreTrainedModel) -> bool:
    config = model.config
    sliding_window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    return (
        config.model_type in SUPPORTED_MODEL_TYPES
        and getattr(config, "hidden_act", "silu") == "silu"
        and sliding_window is None  # a window would need its own mask
        and not getattr(config, "mlp_bias", False)
        # longrope picks its frequencies by the current sequence length on every forward;
        # the rope tables here are computed once, for the cache's capacity. ("dynamic" only
        # changes them past max_position_embeddings, which is also this runner's max_length.)
        and _rope_type(config) != "longrope"
    )


def _rope_type(config) -> str:
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    return rope_parameters.get("rope_type", "default")


_Product = Union[Projection, Int8Projection, W8A16Projection]


@dataclass(frozen=True)
class Int8Recipe:
    """What w8a8 does: which products it leaves in the model's dtype (`keep_float`, names from
    PRODUCTS), which it runs with int8 weights and 16-bit activations (`w8a16`:
    projection.W8A16Projection; the others int8 weights and activations), SmoothQuant's smoothing
    (smoothing.py; alpha, 0 for none) of the w8a8 products, calibrated on a forward of
    `calibration` (token ids; empty: CALIBRATION_TOKENS ids drawn uniformly from the vocabulary
    with a fixed seed, so that no text is needed and the model is the same at every load).

    Neither keep_float nor w8a16 given: the default for this CPU. Where this package's int8
    kernel runs (projection.own_kernel: its AVX512-VNNI or AVX2 build), the output head in w8a16 and every layer product in w8a8: the head
    is the product whose int8 activations cost the most perplexity, and 16-bit ones cost about
    what the bfloat16 head does for fewer bytes read. Elsewhere the w8a16 head would run on
    torch's exact float64 path, slower than bfloat16's, so the head stays in the model's dtype.
    One of them given, the other is empty. The layers are smoothed but o (whose input comes from
    attention, with no weight before it to fold into). benchmarks/int8.py
    measures each choice's perplexity and speed (docs/quantization.md)."""

    keep_float: tuple[str, ...] | None = None
    smoothing: float = 0.5
    calibration: tuple[int, ...] = ()
    # not smoothed: 16-bit activations lose little in quantization, so smoothing would only move
    # error into the weights
    w8a16: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.keep_float is None and self.w8a16 is None:
            wide_head = projections.own_kernel() is not None
            object.__setattr__(self, "keep_float", () if wide_head else ("head",))
            object.__setattr__(self, "w8a16", ("head",) if wide_head else ())
        object.__setattr__(self, "keep_float", tuple(self.keep_float or ()))
        object.__setattr__(self, "w8a16", tuple(self.w8a16 or ()))
        unknown = (set(self.keep_float) | set(self.w8a16)) - set(PRODUCTS)
        if unknown:
            raise ValueError(f"unknown products {sorted(unknown)}; choose among {PRODUCTS}")
        both = set(self.keep_float) & set(self.w8a16)
        if both:
            raise ValueError(f"products {sorted(both)} are both kept in float and w8a16; name each in one")
        if not 0 <= self.smoothing <= 1:
            raise ValueError(f"smoothing is SmoothQuant's alpha, in [0, 1], not {self.smoothing}")

    def calibration_ids(self, vocab_size: int) -> torch.Tensor:  # [n] int64
        if self.calibration:
            return torch.tensor(self.calibration)
        return torch.randint(0, vocab_size, (CALIBRATION_TOKENS,), generator=torch.Generator().manual_seed(0))

    def quantizes(self, product: str) -> bool:
        """Whether the product's weights are int8 (w8a8 or w8a16)."""
        return product not in self.keep_float

    def mode(self, product: str) -> str:  # "float", "w8a8" or "w8a16"
        return "float" if product in self.keep_float else "w8a16" if product in self.w8a16 else "w8a8"


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: _Product  # hidden -> (heads + 2 * kv_heads) * head_dim, with a bias in Qwen2
    o: _Product  # heads * head_dim -> hidden, with a bias in Llama with attention_bias=True
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: _Product  # hidden -> 2 * intermediate
    down: _Product  # intermediate -> hidden


@dataclass(frozen=True)
class _Keys:
    """The keys each new token of a sequence sees, for the tree attention kernel."""

    contiguous: torch.Tensor  # [n] int32: cache positions 0 .. contiguous[i] - 1
    extra: torch.Tensor  # [n, E] int32: then these cache positions, in order, until a -1


@dataclass(frozen=True)
class _Bound:
    """The kernel's call for one sequence in one forward: a function of the data pointers of its
    queries, the layer's keys and values, and its output (tree_attention.TreeAttention.bind)."""

    attend: Callable[[int, int, int, int], None]
    keys: _Keys  # what the call reads, kept alive with it


# how one sequence's new tokens attend: the kernel (_Bound), SDPA with a causal mask over all of
# them (a prefill), or SDPA one query at a time (None: without the kernel)
_Plan = Union[_Bound, torch.Tensor, None]


class FastLlamaRunner(KeepsHiddenStates, StaticCacheRunner):
    """On the model's device and dtype: one sequence in `self.cache` (forward), or several, each
    with a cache of its own (forward_batch, new_cache). quantization int8-weight-only stores
    the layers' products as weight-only int8 (the embedding and output head stay as they are);
    w8a8 runs them on int8 weights and per-row int8 activations (projection.Int8Projection;
    which products, `int8`; by default where the own int8 kernel runs the output head with 16-bit activations,
    projection.W8A16Projection), exact by construction: integer sums do not depend on the rows
    beside a row. Embeddings, norms, attention and the KV cache stay in the model's dtype.

    `hidden_layers` (default none): after each forward, `hidden` holds the hidden states
    entering those decoder layers (index L, the number of layers: the last layer's output before
    the final norm) for every new row, [n, len(hidden_layers), hidden] (forward) or a list of
    them per sequence (forward_batch), in the model's dtype, from the same forward.

    Speculation is lossless only if verifying a token among k others gives the logits that
    decoding it alone would. Other rows in a product or in an attention call can change a
    row's rounding: in bfloat16 one rounding step is ~1e-2, and a speculative run drifted
    from target-only decoding on most benchmark prompts while the batched attention kernel
    rounded 1 and 5 queries differently. On the CPU every product runs on oneDNN
    (projection.Projection, in chunks of 32 rows), which computes each row the same whatever
    rows share it, and attention of decoding and verification forwards (one new token, or
    every new token's logits wanted) runs the tree attention kernel (tree_attention.py): one
    call per layer for all of a sequence's queries, each query's result a function of the
    keys it sees alone. A token's logits then depend neither on the tokens verified with it
    nor on the other sequences of a batch, bit for bit (tests/runners/test_fast_runners.py and
    tests/kernels/test_tree_attention.py check both, with negative controls).

    Trees (`parents`): new token i is written at cache slot length + i but rotated at its
    logical position length + depth_i, and sees the cached prefix, then its ancestors among the
    new tokens and itself; its logits are those of decoding its path alone. `keep(start,
    offsets)` then moves the accepted path's keys and values to consecutive positions.

    Prefills (fewer logits wanted than new tokens) keep SDPA's batched kernel: the engine
    prefills a prompt alone in every mode. Without the kernel (no gcc, compile(), another
    device) verification attends one query at a time through SDPA, as one-token decoding does
    there, and trees are not verified (`verifies_trees` False).
    """

    stacks_sequences = True
    compilable = True

    @property
    def batch_invariant(self) -> bool:
        # compiled, a sequence alone runs inductor's kernels and a batch the eager ones, which
        # may round differently (float32 RMS norms did, in the last bit)
        return super().batch_invariant and self._compiled_layers is None

    @property
    def reuses_prefixes(self) -> bool:
        """The C layers run a prefill as they run a verification (the tree kernel's chain plan:
        each query a function of the keys it sees; every product's row a function of that row),
        so a prompt's suffix after its cached prefix gives bitwise its whole prefill's rows
        (tests/runners/test_prefix_reuse.py). SDPA's batched prefill and torch's products may
        round a row by the rows run with it."""
        return self._int8_layers is not None and projections.row_quantization is None

    @property
    def verifies_trees(self) -> bool:
        return self._kernel is not None and self.per_query_attention

    @property
    def layer_kernel(self) -> str | None:
        """Which code runs the decoder layers, where it is not torch's operations (the response
        cache fingerprints it: its bits are its own)."""
        return int8_layer.kernel_identity() if self._int8_layers is not None else None

    @property
    def embedding_kind(self) -> str:
        """Where token embeddings come from: "int8 codes of the output head" (a w8a8 head tied to
        the embedding: projection.CodedEmbedding) or "the embedding matrix" (the response cache
        fingerprints it)."""
        return "int8 codes of the output head" if isinstance(self.embedding, CodedEmbedding) else "the embedding matrix"

    @property
    def attention_kernel(self) -> str:
        """Which attention decoding and verification run (the response cache fingerprints it)."""
        return tree_attention.kernel_identity() if self.verifies_trees else "sdpa"

    def __init__(
        self,
        model: PreTrainedModel,
        quantization: precision.Quantization | str | None = None,
        int8: Int8Recipe | None = None,
    ):
        if not supports(model):
            raise ValueError(f"FastLlamaRunner does not support {model.config.model_type} models")
        # a Precision's runner_quantization, or its name (the Python API's)
        quantization = precision.quantization_named(quantization, precision.RUNNER)
        if quantization is precision.W8A8 and not (model.device.type == "cpu" and int8_supported()):
            raise ValueError("w8a8 runs on oneDNN's int8 products, on the CPU; this torch or device has none")
        self.quantization = quantization
        self.int8 = (int8 or Int8Recipe()) if quantization is precision.W8A8 else None
        if self.int8 is not None and projections.own_kernel() is None and not has_vnni():
            logger.warning(
                "w8a8: without this package's C kernel (gcc) and without VNNI (AVX512-VNNI, AVX-VNNI or AMX),"
                " oneDNN's products need weights in 7 bits to keep their sums exact"
            )
        config = model.config
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(config.max_position_embeddings)
        self.device, self.dtype = model.device, model.dtype
        self.final_norm = model.model.norm.weight
        smooth = self.int8 is not None and self.int8.smoothing > 0
        maxima = smoothing.input_maxima(model, self.int8.calibration_ids(self.vocab_size)) if smooth else None
        # the output head stays in the model's dtype unless a w8a8 recipe quantizes it (smoothed in w8a8)
        head = model.get_output_embeddings().weight
        if smooth and self.int8.mode("head") == "w8a8":
            with torch.no_grad():  # folded weights keep no autograd graph (it would hold float copies)
                s = smoothing.factors(maxima[-1]["head"], head, self.int8.smoothing)  # [hidden]
                self.final_norm, head = (self.final_norm.float() / s).to(self.final_norm.dtype), head.float() * s
        self.lm_head = self._product("head", head, None)
        tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        head_smoothed = smooth and self.int8.mode("head") == "w8a8"
        # the embedding rows from the head's codes where a quantized head was the embedding itself
        coded = coded_embedding(self.lm_head, self.dtype) if tied and not head_smoothed else None
        self.embedding: Callable[[torch.Tensor], torch.Tensor] = coded or _DenseEmbedding(
            model.get_input_embeddings().weight
        )  # token ids [n] -> [n, hidden]
        self.layers = [self._fuse(layer, maxima[i] if smooth else None) for i, layer in enumerate(model.model.layers)]
        self.hidden: torch.Tensor | list[torch.Tensor] | None = None  # see hidden_layers
        self._rotary = model.model.rotary_emb
        self.per_query_attention = per_query_by_default(self.dtype, self.device)
        # the kernel takes any head size, padding to 16 lanes; the runner keeps it for multiples
        # of 16 (every Llama-family size in use): at head_dim 8 the bfloat16 logits of the tests'
        # tiny models left the tolerance of transformers' (which rounds attention weights to bfloat16)
        exact_here = (
            self.per_query_attention
            and self.head_dim % 16 == 0
            and tree_attention.supports(self.dtype, self.device, self.head_dim)
        )
        self._kernel = tree_attention.load() if exact_here else None
        self._int8_layers = self._bind_int8_layers()
        self.cache = self.new_cache()
        self._cos = self._sin = torch.empty(0, self.head_dim)
        self._compiled_layers = None  # compile() sets it

    def _bind_int8_layers(self) -> int8_layer.BoundLayers | None:
        """w8a8 with every layer product on the own int8 kernel and attention on the tree kernel:
        the layers in one C call a forward (int8_layer.py), for every forward of this runner (its
        bits are not the torch path's, and a forward reads the keys earlier ones wrote)."""
        if self.int8 is None or self._kernel is None or self.dtype not in int8_layer.DTYPES:
            return None
        products = [getattr(layer, name) for layer in self.layers for name in ("qkv", "o", "gate_up", "down")]
        if not all(isinstance(p, Int8Projection) and p.compensation is not None for p in products):
            return None
        if any(p.bias is not None and not p.bias.is_contiguous() for p in products):
            return None
        layers = int8_layer.load()
        if layers is None:
            return None
        return layers.bind(self.layers, self.dtype, self.num_heads, self.num_kv_heads, self.head_dim, self.eps)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_cache(self, capacity: int = INITIAL_CAPACITY) -> StaticKVCache:
        return StaticKVCache(
            len(self.layers), self.num_kv_heads, self.head_dim, self.max_length, self.dtype, self.device, capacity
        )

    def forward(
        self,
        token_ids: torch.Tensor,  # [n]
        num_logits: int,
        parents: torch.Tensor | None = None,  # [n] int64, parents within the new tokens (-1: none); None: a chain
    ) -> torch.Tensor:  # [num_logits, vocab]
        if parents is None:  # a chain: the call as it was before trees (spies and subclasses may rely on it)
            logits = self.forward_batch([self.cache], [token_ids], [num_logits])[0]
        else:
            logits = self.forward_batch([self.cache], [token_ids], [num_logits], parents=[parents])[0]
        if self.hidden is not None:
            self.hidden = self.hidden[0]
        return logits

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: list[StaticKVCache],  # one per sequence, each holding that sequence's prefix
        token_ids: list[torch.Tensor],  # [n_i] new tokens of sequence i, run after its cache
        num_logits: list[int],  # logits wanted for the last num_logits[i] new tokens of sequence i
        parents: list[torch.Tensor | None] | None = None,  # per sequence: [n_i] int64 (a tree) or None (a chain)
    ) -> list[torch.Tensor]:  # [num_logits[i], vocab] per sequence
        """Several sequences in one pass: their new tokens are stacked into one [sum n_i, hidden]
        matrix for every projection (no padding); only attention runs per sequence. A sequence
        with parents runs a tree (every row's logits wanted): token i at logical position
        length + depth_i, seeing the cache, its ancestors and itself."""
        sizes = [t.shape[0] for t in token_ids]
        parents = [None] * len(caches) if parents is None else parents
        trees = [
            None if p is None else self._tree(c.length, p, n, m)
            for c, p, n, m in zip(caches, parents, sizes, num_logits)
        ]
        for cache, n in zip(caches, sizes):
            cache.reserve(n)
        if self._cos.shape[0] < max(cache.capacity for cache in caches):
            self._rope_tables(max(cache.capacity for cache in caches))
        x = self.embedding(torch.cat(token_ids).to(self.device))  # [sum n_i, hidden]
        cos = torch.cat([self._rows(self._cos, c.length, n, tree) for c, n, tree in zip(caches, sizes, trees)])
        sin = torch.cat([self._rows(self._sin, c.length, n, tree) for c, n, tree in zip(caches, sizes, trees)])
        total = sum(sizes)
        keep = self._hidden_layers
        # the C layers quantize rows as quantize_rows does; another row quantization runs on torch's path
        if self._int8_layers is not None and projections.row_quantization is None:
            keys = [
                (tree[1].contiguous, tree[1].extra) if tree is not None else self._chain(cache.length, n)
                for cache, n, tree in zip(caches, sizes, trees)
            ]
            x = x.contiguous()
            kept = self._int8_layers(x, [cos.contiguous()], [sin.contiguous()], caches, sizes, keys, keep)
            self.hidden = list(torch.stack([kept[i] for i in keep], dim=1).split(sizes)) if keep else None
            return self._finish(caches, sizes, parents, num_logits, x)
        plans = [
            self._bind(tree[1] if tree is not None else self._plan(cache, n, m), cache, total)
            for cache, n, m, tree in zip(caches, sizes, num_logits, trees)
        ]
        kv = [(cache.keys, cache.values, cache.length) for cache in caches]
        compiled = self._compiled_layers is not None and len(caches) == 1 and plans[0] is None and not keep
        kept: dict[int, torch.Tensor] = {}  # layer index -> [sum n_i, hidden], filled by _layers
        if compiled:
            x = self._compiled_layers(x, cos, sin, kv, sizes, plans)
        else:
            x = self._layers(x, cos, sin, kv, sizes, plans, keep, kept)
        self.hidden = list(torch.stack([kept[i] for i in keep], dim=1).split(sizes)) if keep else None
        return self._finish(caches, sizes, parents, num_logits, x)

    def _finish(self, caches, sizes, parents, num_logits, x: torch.Tensor) -> list[torch.Tensor]:
        for cache, n, p in zip(caches, sizes, parents):
            cache.advance(n, None if p is None else p.tolist())
        ends = itertools.accumulate(sizes)
        last = torch.cat([x[end - m : end] for end, m in zip(ends, num_logits)])  # [sum num_logits, hidden]
        logits = self.lm_head(_rms_norm(last, self.final_norm, self.eps))
        return list(logits.float().cpu().split(num_logits))

    def _bind(self, plan: _Keys | torch.Tensor | None, cache: StaticKVCache, total: int) -> _Plan:
        """A kernel plan bound to this forward: outputs [total, heads, d] (the queries' strides are
        given with each call)."""
        if not isinstance(plan, _Keys):
            return plan
        d, heads = self.head_dim, self.num_heads
        attend = self._kernel.bind(
            self.dtype, heads, self.num_kv_heads, d, (total * d, d), cache.capacity, (d, heads * d),
            plan.contiguous, plan.extra, d**-0.5,
        )  # fmt: skip
        return _Bound(attend, plan)

    @staticmethod
    def _chain(length: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tree kernel's plan for a chain of n new tokens after length cached ones, a prefill
        too: query i sees positions 0 .. length + i."""
        return torch.arange(length + 1, length + n + 1, dtype=torch.int32), torch.empty(n, 0, dtype=torch.int32)

    def _plan(self, cache: StaticKVCache, n: int, num_logits: int) -> _Keys | torch.Tensor | None:
        """A chain's attention: decoding and verification on the kernel (query i sees the cache
        and the new tokens up to itself), else one query at a time; a prefill batched."""
        if n == 1 or num_logits == n:
            if self.verifies_trees:
                contiguous = torch.arange(cache.length + 1, cache.length + n + 1, dtype=torch.int32)
                return _Keys(contiguous, torch.empty(n, 0, dtype=torch.int32))
            if self.per_query_attention:
                return None
        return cache.causal_mask(n)

    def _tree(
        self, length: int, parents: torch.Tensor, n: int, num_logits: int
    ) -> tuple[torch.Tensor, _Keys]:  # logical positions [n], and the keys each token sees
        if not self.verifies_trees:
            raise ValueError("this runner does not verify trees (verifies_trees is False): pass parents=None")
        positions, contiguous, extra = tree_attention.tree_plan(length, parents, n, num_logits)
        return positions.to(self.device), _Keys(contiguous, extra)

    @staticmethod
    def _rows(
        table: torch.Tensor, length: int, n: int, tree: tuple[torch.Tensor, _Keys] | None
    ) -> torch.Tensor:  # [n, head_dim] rows of a rope table at the new tokens' logical positions
        return table[length : length + n] if tree is None else table[tree[0]]

    def compile(self) -> None:
        """Run one sequence's decoding and verification forwards compiled by torch.compile
        (inductor), attending one query at a time through SDPA (the tree attention kernel is
        off, and with it trees: verifies_trees becomes False). Batches of sequences and
        prefills stay eager. The first forward of each
        size compiles, which is slow (docs/speed.md); inductor keeps
        the code on disk, so later processes pay less. Exactness holds as in eager: a verified
        token's logits are bitwise those of decoding it alone, compiled too
        (tests/runners/test_compiled.py). benchmarks/compiled.py measures what it gains, where the
        products, which it cannot speed up, are most of a forward (docs/speed.md)."""
        # a graph per forward size (1 to k + 1 tokens); the cache length is a symbol in each
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # round every bfloat16 intermediate as eager does: inductor otherwise keeps fused chains
        # (the residual sums) in float32, and a token's logits would differ from eager decoding's
        self._compiled_layers = torch.compile(self._layers, dynamic=True, options={"emulate_precision_casts": True})
        # inductor cannot look into the kernel: compiled forwards attend one query at a time
        self._kernel = None
        self._int8_layers = None

    def _layers(
        self,
        x: torch.Tensor,  # [sum n_i, hidden], the new tokens' embeddings
        cos: torch.Tensor,  # [sum n_i, head_dim]
        sin: torch.Tensor,  # [sum n_i, head_dim]
        kv: list[tuple[list[torch.Tensor], list[torch.Tensor], int]],  # per sequence: keys, values, cached length
        sizes: list[int],  # n_i
        plans: list[_Plan],  # per sequence, how its new tokens attend
        keep: tuple[int, ...] = (),  # layers whose input to put in `kept` (len(layers): the output)
        kept: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [sum n_i, hidden], the last layer's output
        for i, layer in enumerate(self.layers):
            if i in keep:
                kept[i] = x
            x = x + self._attention(i, layer, _rms_norm(x, layer.attn_norm, self.eps), cos, sin, kv, sizes, plans)
            gate, up = layer.gate_up(_rms_norm(x, layer.mlp_norm, self.eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        if len(self.layers) in keep:
            kept[len(self.layers)] = x
        return x

    def _attention(
        self,
        index: int,
        layer: _Layer,
        h: torch.Tensor,  # [sum n_i, hidden]
        cos: torch.Tensor,  # [sum n_i, head_dim]
        sin: torch.Tensor,  # [sum n_i, head_dim]
        kv: list[tuple[list[torch.Tensor], list[torch.Tensor], int]],
        sizes: list[int],
        plans: list[_Plan],
    ) -> torch.Tensor:  # [sum n_i, hidden]
        total, d, heads, kv_heads = h.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = layer.qkv(h).view(total, heads + 2 * kv_heads, d)
        # queries and keys rotated in one pass (the same arithmetic per element, half the calls)
        q, k = _rope(qkv[:, : heads + kv_heads].transpose(0, 1), cos, sin).split([heads, kv_heads])
        v = qkv[:, heads + kv_heads :].transpose(0, 1)  # q [heads, sum n_i, d]; k, v [kv_heads, sum n_i, d]
        if not any(isinstance(plan, _Bound) for plan in plans):  # SDPA alone (what compile() traces)
            outs = [
                attend(q_i, *append(keys[index], values[index], length, k_i, v_i), plan).transpose(0, 1)
                for (keys, values, length), q_i, k_i, v_i, plan in zip(
                    kv, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1), plans
                )
            ]  # [n_i, heads, d] per sequence
            out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [sum n_i, heads, d]
            return layer.o(out.reshape(total, heads * d))
        q = q if q.stride(2) == 1 else q.contiguous()  # the kernel reads a query's d elements in a row
        out = torch.empty(total, heads, d, dtype=q.dtype, device=q.device)  # [sum n_i, heads, d]
        size, start = q.element_size(), 0
        for (keys, values, length), k_i, v_i, n, plan in zip(kv, k.split(sizes, 1), v.split(sizes, 1), sizes, plans):
            keys_so_far, values_so_far = append(keys[index], values[index], length, k_i, v_i)
            if isinstance(plan, _Bound):  # q [heads, sum n_i, d] strided, out [sum n_i, heads, d] contiguous
                q_at, out_at = q.data_ptr() + start * q.stride(1) * size, out.data_ptr() + start * heads * d * size
                plan.attend(q_at, keys[index].data_ptr(), values[index].data_ptr(), out_at, q.stride()[:2])
            else:
                out[start : start + n] = attend(q[:, start : start + n], keys_so_far, values_so_far, plan).transpose(
                    0, 1
                )
            start += n
        return layer.o(out.reshape(total, heads * d))

    def _copied_modules(self):
        for layer, fused in zip(self.model.model.layers, self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            yield from (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)  # fused: new tensors
            yield from (m for m, p in ((attn.o_proj, fused.o), (mlp.down_proj, fused.down)) if p.is_copy)
        head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        coded = isinstance(self.embedding, CodedEmbedding)
        if self.lm_head.is_copy and (head.weight is not embedding.weight or coded):
            yield head  # a head tied to a dense embedding stays: the embedding reads it
        if coded:
            yield embedding

    def _rope_tables(self, length: int) -> None:
        positions = torch.arange(length, device=self.device)[None]
        like = torch.empty(1, 1, self.head_dim, dtype=self.dtype, device=self.device)  # its dtype and device
        cos, sin = self._rotary(like, positions)  # transformers' own rope tables
        self._cos, self._sin = cos[0].to(self.dtype), sin[0].to(self.dtype)

    @torch.no_grad()  # folded weights keep no autograd graph (it would hold float copies of them)
    def _fuse(self, layer: torch.nn.Module, maxima: dict[str, torch.Tensor] | None = None) -> _Layer:
        """maxima (smoothing): the calibration's largest input magnitudes of the layer's products."""
        attn, mlp = layer.self_attn, layer.mlp
        q_k_v = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv_bias = torch.cat([p.bias for p in q_k_v]) if attn.q_proj.bias is not None else None
        # the parameters themselves where nothing is folded into them (release_model_weights moves them)
        attn_norm, mlp_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        qkv, gate, up, down = (
            torch.cat([p.weight for p in q_k_v]),
            mlp.gate_proj.weight,
            mlp.up_proj.weight,
            mlp.down_proj.weight,
        )
        if maxima is not None:
            alpha = self.int8.smoothing
            if self.int8.mode("down") == "w8a8":
                s = smoothing.factors(maxima["down"], down, alpha)  # [intermediate]
                up, down = (up.float() / s[:, None]).to(up.dtype), down.float() * s
            gate_up = torch.cat([gate, up])
            if self.int8.mode("qkv") == "w8a8":
                s = smoothing.factors(maxima["qkv"], qkv, alpha)
                attn_norm, qkv = (attn_norm.float() / s).to(attn_norm.dtype), qkv.float() * s
            if self.int8.mode("gate_up") == "w8a8":
                s = smoothing.factors(maxima["gate_up"], gate_up, alpha)
                mlp_norm, gate_up = (mlp_norm.float() / s).to(mlp_norm.dtype), gate_up.float() * s
        else:
            gate_up = torch.cat([gate, up])
        return _Layer(
            attn_norm=attn_norm,
            qkv=self._product("qkv", qkv, qkv_bias),
            o=self._product("o", attn.o_proj.weight, attn.o_proj.bias),
            mlp_norm=mlp_norm,
            gate_up=self._product("gate_up", gate_up, None),
            down=self._product("down", down, None),
        )

    def _product(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> _Product:  # weight [out, in]
        if self.int8 is not None and self.int8.quantizes(name):
            bias = None if bias is None else bias.to(self.dtype)
            return w8a16_projection(weight, bias) if self.int8.mode(name) == "w8a16" else int8_projection(weight, bias)
        if name == "head" or self.quantization is not precision.INT8_WEIGHT_ONLY:
            return projection(weight, bias, None)
        return projection(weight, bias, precision.INT8_WEIGHT_ONLY)


class _DenseEmbedding:
    def __init__(self, weight: torch.Tensor):  # [vocab, hidden], the model's own parameter
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:  # [n] int64 -> [n, hidden]
        return F.embedding(ids, self.weight)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as transformers' LlamaRMSNorm: normalise in float32, scale in the model's dtype
    # (F.rms_norm gives transformers' bits here, in one call instead of five)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of x [heads, n, d] by the position angles; cos, sin [n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
