"""A lean forward pass for Llama-family models (Llama, SmolLM2, Mistral, Qwen2).

Same weights and the same arithmetic as transformers' modeling, without its per-call
machinery, and shaped for speculative decoding:
- a static KV cache (static_cache.StaticKVCache): rollback moves a length, copies nothing;
- fused projections (q|k|v, gate|up): fewer, larger matrix products, each weight kept once,
  in the layout oneDNN wants (projection.py), or as weight-only int8;
- logits only for the positions the caller asks for;
- on the CPU, verification attends one query at a time, so that a token's logits are
  bitwise the same whether it is verified among others or decoded alone (see FastLlamaRunner).

It implements `runners.base.ModelRunner`; `supports(model)` says when it applies. Outputs
match transformers' to float rounding (tests/test_fast_runners.py states the tolerance).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdecode.runners.attention import attend, per_query_by_default
from specdecode.runners.projection import Projection, projection
from specdecode.runners.static_cache import StaticCacheRunner, StaticKVCache, append

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
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


@dataclass
class _Layer:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Projection  # hidden -> (heads + 2 * kv_heads) * head_dim, with a bias in Qwen2
    o: Projection  # heads * head_dim -> hidden, with a bias in Llama with attention_bias=True
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Projection  # hidden -> 2 * intermediate
    down: Projection  # intermediate -> hidden


class FastLlamaRunner(StaticCacheRunner):
    """On the model's device and dtype: one sequence in `self.cache` (forward), or several, each
    with a cache of its own (forward_batch, new_cache). quantization="int8" stores the layers'
    products as weight-only int8 (the embedding and output head stay as they are).

    Speculation is lossless only if verifying a token among k others gives the logits that
    decoding it alone would. Other rows in a product or in an attention call can change a
    row's rounding: in bfloat16 one rounding step is ~1e-2, and a speculative run drifted
    from target-only decoding on most benchmark prompts while the batched attention kernel
    rounded 1 and 5 queries differently. On the CPU every product runs on oneDNN
    (projection.Projection, in chunks of 32 rows), which computes each row the same whatever
    rows share it, and with `per_query_attention` (on there, in every dtype) a verification
    forward (one that wants every new token's logits) attends one query at a time, exactly
    as a one-token forward does. A token's logits then depend neither on the tokens
    verified with it nor on the other sequences of a batch, bit for bit
    (tests/test_fast_runners.py checks both, with negative controls). Prefills (one logit
    wanted) keep the batched kernel: one query at a time is ~10x slower for a 500-token
    prompt, and the engine prefills a prompt alone in every mode anyway.
    """

    stacks_sequences = True
    compilable = True

    @property
    def batch_invariant(self) -> bool:
        # compiled, a sequence alone runs inductor's kernels and a batch the eager ones, which
        # may round differently (float32 RMS norms did, in the last bit)
        return super().batch_invariant and self._compiled_layers is None

    def __init__(self, model: PreTrainedModel, quantization: str | None = None):
        if not supports(model):
            raise ValueError(f"FastLlamaRunner does not support {model.config.model_type} models")
        config = model.config
        self.model = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(config.max_position_embeddings)
        self.device, self.dtype = model.device, model.dtype
        self.embed = model.get_input_embeddings().weight
        self.final_norm = model.model.norm.weight
        # the output head stays in the model's dtype (int8 would cost too much accuracy here)
        self.lm_head = projection(model.get_output_embeddings().weight, None, None)
        self.layers = [_fuse(layer, quantization) for layer in model.model.layers]
        self._rotary = model.model.rotary_emb
        self.per_query_attention = per_query_by_default(self.dtype, self.device)
        self.cache = self.new_cache()
        self._cos = self._sin = torch.empty(0, self.head_dim)
        self._compiled_layers = None  # compile() sets it

    def new_cache(self, capacity: int = INITIAL_CAPACITY) -> StaticKVCache:
        return StaticKVCache(
            len(self.layers), self.num_kv_heads, self.head_dim, self.max_length, self.dtype, self.device, capacity
        )

    def forward(self, token_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        return self.forward_batch([self.cache], [token_ids], [num_logits])[0]

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: list[StaticKVCache],  # one per sequence, each holding that sequence's prefix
        token_ids: list[torch.Tensor],  # [n_i] new tokens of sequence i, run after its cache
        num_logits: list[int],  # logits wanted for the last num_logits[i] new tokens of sequence i
    ) -> list[torch.Tensor]:  # [num_logits[i], vocab] per sequence
        """Several sequences in one pass: their new tokens are stacked into one [sum n_i, hidden]
        matrix for every projection (no padding); only attention runs per sequence."""
        sizes = [t.shape[0] for t in token_ids]
        for cache, n in zip(caches, sizes):
            cache.reserve(n)
        if self._cos.shape[0] < max(cache.capacity for cache in caches):
            self._rope_tables(max(cache.capacity for cache in caches))
        x = F.embedding(torch.cat(token_ids).to(self.device), self.embed)  # [sum n_i, hidden]
        cos = torch.cat([self._cos[c.length : c.length + n] for c, n in zip(caches, sizes)])  # [sum n_i, head_dim]
        sin = torch.cat([self._sin[c.length : c.length + n] for c, n in zip(caches, sizes)])
        one_by_one = [self.per_query_attention and m == n for n, m in zip(sizes, num_logits)]
        masks = [None if alone else cache.causal_mask(n) for cache, n, alone in zip(caches, sizes, one_by_one)]
        kv = [(cache.keys, cache.values, cache.length) for cache in caches]
        compiled = self._compiled_layers is not None and len(caches) == 1 and masks[0] is None
        x = (self._compiled_layers if compiled else self._layers)(x, cos, sin, kv, sizes, masks)
        for cache, n in zip(caches, sizes):
            cache.advance(n)
        ends = itertools.accumulate(sizes)
        last = torch.cat([x[end - m : end] for end, m in zip(ends, num_logits)])  # [sum num_logits, hidden]
        logits = self.lm_head(_rms_norm(last, self.final_norm, self.eps))
        return list(logits.float().cpu().split(num_logits))

    def compile(self) -> None:
        """Run one sequence's decoding and verification forwards compiled by torch.compile
        (inductor). Batches of sequences and prefills stay eager. The first forward of each
        size compiles: about a minute per size for the default model on 2 cores; inductor keeps
        the code on disk, so later processes pay less. Exactness holds as in eager: a verified
        token's logits are bitwise those of decoding it alone, compiled too
        (tests/test_compiled.py). benchmarks/compiled.py measures what it gains: nothing
        measurable on a 2-core AMD EPYC, where the products are ~70% of a forward."""
        # a graph per forward size (1 to k + 1 tokens); the cache length is a symbol in each
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # round every bfloat16 intermediate as eager does: inductor otherwise keeps fused chains
        # (the residual sums) in float32, and a token's logits would differ from eager decoding's
        self._compiled_layers = torch.compile(self._layers, dynamic=True, options={"emulate_precision_casts": True})

    def _layers(
        self,
        x: torch.Tensor,  # [sum n_i, hidden], the new tokens' embeddings
        cos: torch.Tensor,  # [sum n_i, head_dim]
        sin: torch.Tensor,  # [sum n_i, head_dim]
        kv: list[tuple[list[torch.Tensor], list[torch.Tensor], int]],  # per sequence: keys, values, cached length
        sizes: list[int],  # n_i
        masks: list[torch.Tensor | None],  # [n_i, cached_i + n_i] bool; None: each query alone
    ) -> torch.Tensor:  # [sum n_i, hidden], the last layer's output
        for i, layer in enumerate(self.layers):
            x = x + self._attention(i, layer, _rms_norm(x, layer.attn_norm, self.eps), cos, sin, kv, sizes, masks)
            gate, up = layer.gate_up(_rms_norm(x, layer.mlp_norm, self.eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
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
        masks: list[torch.Tensor | None],
    ) -> torch.Tensor:  # [sum n_i, hidden]
        total, d, heads, kv_heads = h.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        qkv = layer.qkv(h).view(total, heads + 2 * kv_heads, d)
        # queries and keys rotated in one pass (the same arithmetic per element, half the calls)
        q, k = _rope(qkv[:, : heads + kv_heads].transpose(0, 1), cos, sin).split([heads, kv_heads])
        v = qkv[:, heads + kv_heads :].transpose(0, 1)  # q [heads, sum n_i, d]; k, v [kv_heads, sum n_i, d]
        outs = []
        for (keys, values, length), q_i, k_i, v_i, mask in zip(
            kv, q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1), masks
        ):
            keys_so_far, values_so_far = append(keys[index], values[index], length, k_i, v_i)
            outs.append(attend(q_i, keys_so_far, values_so_far, mask))
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [heads, sum n_i, d]
        return layer.o(out.transpose(0, 1).reshape(total, self.num_heads * d))

    def _copied_modules(self):
        for layer, fused in zip(self.model.model.layers, self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            yield from (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)  # fused: new tensors
            yield from (m for m, p in ((attn.o_proj, fused.o), (mlp.down_proj, fused.down)) if p.is_copy)
        head = self.model.get_output_embeddings()
        if self.lm_head.is_copy and head.weight is not self.model.get_input_embeddings().weight:
            yield head  # a head tied to the embedding stays: the embedding reads it

    def _rope_tables(self, length: int) -> None:
        positions = torch.arange(length, device=self.device)[None]
        cos, sin = self._rotary(self.embed[:1][None], positions)  # transformers' own rope tables
        self._cos, self._sin = cos[0].to(self.dtype), sin[0].to(self.dtype)


def _fuse(layer: torch.nn.Module, quantization: str | None) -> _Layer:
    attn, mlp = layer.self_attn, layer.mlp
    q_k_v = (attn.q_proj, attn.k_proj, attn.v_proj)
    qkv_bias = torch.cat([p.bias for p in q_k_v]) if attn.q_proj.bias is not None else None
    return _Layer(
        attn_norm=layer.input_layernorm.weight,  # the parameters themselves (release_model_weights moves them)
        qkv=projection(torch.cat([p.weight for p in q_k_v]), qkv_bias, quantization),
        o=projection(attn.o_proj.weight, attn.o_proj.bias, quantization),
        mlp_norm=layer.post_attention_layernorm.weight,
        gate_up=projection(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None, quantization),
        down=projection(mlp.down_proj.weight, None, quantization),
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as transformers' LlamaRMSNorm: normalise in float32, scale in the model's dtype
    # (F.rms_norm gives transformers' bits here, in one call instead of five)
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of x [heads, n, d] by the position angles; cos, sin [n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
