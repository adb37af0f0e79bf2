"""Any transformers decoder on the engine's kernels: transformers' modeling code for what differs
between architectures, the engine's products and attention for the bits and the time.

The model's module tree is shadowed (`_shadow`: new module objects sharing the model's tensors,
so the model itself runs as before) and, in the shadow:
- every `nn.Linear` of the decoder layers is replaced by one of the fast paths' products
  (projection.py: oneDNN's reordered weights, weight-only int8, or `w8a8`'s exact int8 ones),
  whose rows do not depend on the rows beside them;
- attention is the tree attention kernel (tree_attention.py), registered with transformers'
  attention interface and named in the shadow's config: transformers then builds no mask, and
  every layer calls `_attend`, which writes the new keys and values to this runner's static
  cache and runs the kernel over the keys each query sees (sliding windows and soft-capping
  where the architecture asks for them);
- the output head runs only on the rows whose logits are wanted.

With `w8a8`, architectures whose layers follow one of the C decoder's recipes (`C_RECIPES`:
Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3) run every decoder layer of a forward in one C call instead
(int8_layer.py: the Python and dispatch around ~20 modules a layer are most of a small model's
forward); the embeddings, rotary tables, final norm and head stay transformers' and the runner's.

Norms, rotary embeddings (of the logical positions: trees too), q/k norms, scaled embeddings and
activations stay transformers' own, element-wise or per row; so a row's logits are a function of
that row and the keys it sees, whatever shares its forward (tests/runners/test_fast_transformers.py
checks it bit for bit, with a negative control, for every architecture listed there).
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel

from specdecode import precision
from specdecode.kernels import int8_layer, tree_attention
from specdecode.runners.projection import (
    Int8Projection,
    int8_projection,
    int8_supported,
    own_kernel,
    projection,
    w8a16_projection,
)
from specdecode.runners.static_cache import KeepsHiddenStates, StaticCacheRunner, StaticKVCache

ATTENTION = "specdecode-tree"  # the name of _attend in transformers' attention interface
INITIAL_CAPACITY = 1024
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
# architectures whose layers do more than attention and an MLP of linear layers per token (state
# spaces, recurrent or linear attention, routed experts): their own code, or other bits per batch
UNSUPPORTED_MODEL_TYPES = frozenset({"gemma3n", "qwen3_next", "lfm2", "falcon_h1", "jamba", "bamba", "zamba"})
# model types whose layers the C decoder computes (csrc/int8_layer.c's recipes) -> their norm; the
# activation is read from the config, and each layer's attention parameters (scale, sliding window,
# soft-capping) from what its own code passes to the attention interface (`_attention_arguments`)
C_RECIPES = {
    **dict.fromkeys(("llama", "mistral", "qwen2", "qwen3"), "rounded"),
    **dict.fromkeys(("gemma2", "gemma3_text"), "plus-one"),
}
C_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu-tanh"}  # transformers' name -> the C file's


def unsupported(model: PreTrainedModel) -> str | None:
    """Why this runner cannot run the model exactly, or None where it can."""
    config = model.config
    layers = getattr(model.base_model, "layers", None)
    reason = _config_reason(config, type(model))
    if reason is not None:
        return reason
    if not isinstance(layers, nn.ModuleList) or model.get_output_embeddings() is None:
        return f"{config.model_type} models keep no decoder layers at base_model.layers, or no output head"
    linear = {id(m.weight) for m in layers.modules() if type(m) is nn.Linear}
    other = [name for name, p in layers.named_parameters() if p.dim() >= 2 and id(p) not in linear]
    if other:
        return f"{config.model_type} layers hold matrices outside nn.Linear ({other[0]})"
    if model.device.type != "cpu" or model.dtype not in tree_attention.DTYPES:
        return "the tree attention kernel runs on the CPU, in float32, bfloat16 or float16"
    return None


def _config_reason(config, model_class: type | None) -> str | None:
    if config.model_type in UNSUPPORTED_MODEL_TYPES or getattr(config, "is_encoder_decoder", False):
        return f"{config.model_type} models are not plain decoders"
    if getattr(config, "use_bidirectional_attention", False):
        return f"this {config.model_type} model attends to later tokens (use_bidirectional_attention)"
    if model_class is None or not getattr(model_class, "_supports_attention_backend", False):
        return f"{config.model_type} models do not call transformers' attention interface"
    if not hasattr(config, "num_attention_heads") or not hasattr(config, "hidden_size"):
        return f"{config.model_type} configs name no attention heads"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not layer_types <= ATTENTION_LAYER_TYPES:
        return f"{config.model_type} layers of types {sorted(layer_types - ATTENTION_LAYER_TYPES)}"
    if any(getattr(config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts")):
        return f"{config.model_type} models route tokens to experts"
    if _head_dim(config) > tree_attention.MAX_HEAD_DIM:
        return f"head_dim {_head_dim(config)} > {tree_attention.MAX_HEAD_DIM}"
    if "longrope" in _rope_types(getattr(config, "rope_parameters", None)):
        # its frequencies follow the longest position of each forward: a verified row would get
        # other angles than decoding it alone
        return "longrope rotary embeddings change with each forward's length"
    return None


def _rope_types(parameters) -> set[str]:
    """Every rope_type of a config's rope_parameters (one dict, or one per layer type)."""
    if not isinstance(parameters, dict):
        return set()
    own = {parameters["rope_type"]} if isinstance(parameters.get("rope_type"), str) else set()
    return own.union(*(_rope_types(value) for value in parameters.values() if isinstance(value, dict)))


def supports_config(config) -> bool:
    """Whether a model of this config would run here (what --dtype auto decides on, before loading)."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return _config_reason(config, model_class) is None


def supports(model: PreTrainedModel) -> bool:
    return unsupported(model) is None


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class _Linear(nn.Module):
    """An nn.Linear's place in the shadow, run by a fast-path product on [rows, in]."""

    def __init__(self, product: Callable[[torch.Tensor], torch.Tensor], out_features: int):
        super().__init__()
        self.product, self.out_features = product, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.product(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)


@dataclass
class _Sequence:
    """One sequence of a forward: its cache, where its rows start among the forward's, and the
    keys each of its new tokens sees."""

    cache: StaticKVCache
    start: int  # its first row among the forward's rows
    n: int
    positions: torch.Tensor  # [n] logical positions
    contiguous: torch.Tensor  # [n] int32: cache positions 0 .. contiguous[i] - 1
    extra: torch.Tensor  # [n, E] int32: then these cache positions (a tree's ancestors), until a -1
    bound: dict = field(default_factory=dict)  # (window, scale, softcap) -> the kernel's call
    firsts: dict = field(default_factory=dict)  # window -> [n] int32 first positions (kept alive)


@dataclass
class _Forward:
    """What _attend needs in one forward: the runner's kernel and the sequences."""

    kernel: tree_attention.TreeAttention
    sequences: list[_Sequence]
    total: int

    def attend(
        self,
        layer: int,
        q: torch.Tensor,  # [1, heads, total, d]
        k: torch.Tensor,  # [1, kv_heads, total, d]
        v: torch.Tensor,  # [1, kv_heads, total, d]
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:  # [1, total, heads, d]
        _, heads, total, d = q.shape
        kv_heads = k.shape[1]
        q = q if q.stride(3) == 1 else q.contiguous()
        out = torch.empty(total, heads, d, dtype=q.dtype)
        size = q.element_size()
        for s in self.sequences:
            keys, values = s.cache.keys[layer], s.cache.values[layer]
            length = s.cache.length
            keys[:, length : length + s.n] = k[0, :, s.start : s.start + s.n]
            values[:, length : length + s.n] = v[0, :, s.start : s.start + s.n]
            call = self._bound(s, q, heads, kv_heads, d, scale, window, softcap or 0.0)
            q_at = q.data_ptr() + s.start * q.stride(2) * size
            out_at = out.data_ptr() + s.start * heads * d * size
            call(q_at, keys.data_ptr(), values.data_ptr(), out_at, (q.stride(1), q.stride(2)))
        return out.unsqueeze(0)

    def _bound(self, s: _Sequence, q, heads, kv_heads, d, scale, window, softcap):
        key = (window, scale, softcap)
        if key not in s.bound:
            first = None
            if window is not None:  # a query at position p sees positions p - window + 1 .. p
                if s.extra.shape[1] >= window:
                    raise ValueError(f"a tree {s.extra.shape[1]} deep reaches past the sliding window of {window}")
                first = (s.positions - window + 1).clamp(min=0).to(torch.int32).minimum(s.contiguous)
                s.firsts[window] = first
            s.bound[key] = self.kernel.bind(
                q.dtype, heads, kv_heads, d, (q.stride(1), q.stride(2)), s.cache.capacity, (d, heads * d),
                s.contiguous, s.extra, scale, first, softcap,
            )  # fmt: skip
        return s.bound[key]


class _Probe:
    """In place of _Forward: records what each layer passes to the attention interface."""

    def __init__(self):
        self.calls: dict[int, tuple[float, int, float]] = {}

    def attend(self, layer, q, k, v, scale, window, softcap) -> torch.Tensor:  # q: [1, heads, total, d]
        self.calls[layer] = (float(scale), int(window or 0), float(softcap or 0.0))
        return torch.zeros(1, q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)


def _attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface, on the runner's cache and kernel (kwargs carry the
    forward's _Forward as `specdecode_forward`)."""
    forward: _Forward | None = kwargs.get("specdecode_forward")
    if forward is None:
        raise RuntimeError("the specdecode attention runs inside FastTransformersRunner's forwards only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    out = forward.attend(module.layer_idx, query, key, value, scale, window, kwargs.get("softcap"))
    return out, None


AttentionInterface.register(ATTENTION, _attend)


def _takes_layer_type(rotary: nn.Module) -> bool:
    """Whether a rotary module computes one table per layer type (Gemma 3: local and global)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def _fused_int8(linears: list[nn.Linear], dtype: torch.dtype) -> Int8Projection:
    """One w8a8 product of several linear layers' outputs side by side (q|k|v, gate|up)."""
    biases = [linear.bias for linear in linears]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [b if b is not None else torch.zeros(linear.out_features) for b, linear in zip(biases, linears)]
        ).to(dtype)
    )
    with torch.no_grad():
        return int8_projection(torch.cat([linear.weight for linear in linears]), bias)


def _shadow(module: nn.Module, config, shadow_config) -> nn.Module:
    """A copy of the module tree whose modules are new objects (their own children, hooks and
    config) sharing the model's parameters and buffers."""
    clone = copy.copy(module)
    for name, value in vars(module).items():
        if isinstance(value, dict):
            setattr(clone, name, type(value)(value))
        elif value is config:
            setattr(clone, name, shadow_config)
    clone._modules = {name: _shadow(child, config, shadow_config) for name, child in module._modules.items()}
    return clone


class FastTransformersRunner(KeepsHiddenStates, StaticCacheRunner):
    """See the module's docstring. quantization: None, int8-weight-only or w8a8 (the decoder
    layers' products; w8a8's output head with 16-bit activations where the own int8 kernel
    runs, as the Llama runner's default recipe, without smoothing)."""

    stacks_sequences = True
    compilable = False
    per_query_attention = True
    verifies_trees = True
    embedding_kind = "the embedding matrix"

    def __init__(self, model: PreTrainedModel, quantization: precision.Quantization | str | None = None):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"FastTransformersRunner cannot run this model: {reason}")
        self._kernel = tree_attention.load()
        if self._kernel is None:
            raise ValueError("FastTransformersRunner needs the tree attention kernel (gcc)")
        quantization = precision.quantization_named(quantization, precision.RUNNER)
        if quantization is precision.W8A8 and not int8_supported():
            raise ValueError("w8a8 runs on oneDNN's int8 products, on the CPU; this torch has none")
        self.quantization = quantization
        config = model.config
        self.model = model
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(config, "max_position_embeddings", 0) or 2**16)
        self.device, self.dtype = model.device, model.dtype
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.head_dim = _head_dim(config)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        shadow_config = copy.copy(config)
        shadow_config._attn_implementation = ATTENTION
        self.decoder = _shadow(model.base_model, config, shadow_config)
        self.products: list = []  # every product, for the response cache's fingerprint
        self._c_layers = self._bind_c_layers()
        if self._c_layers is None:
            self._replace_linears(self.decoder.layers)
        head = model.get_output_embeddings()
        self.lm_head = self._product(head.weight, getattr(head, "bias", None), head=True)
        self.products.append(self.lm_head)
        self.num_layers = len(self.decoder.layers)
        self._kept: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.decoder.layers):
            layer.register_forward_pre_hook(self._keep_input(i), with_kwargs=True)
        self.decoder.layers[-1].register_forward_hook(self._keep_output)
        self.cache = self.new_cache()

    @property
    def attention_kernel(self) -> str:
        return tree_attention.kernel_identity()

    @property
    def layer_kernel(self) -> str | None:
        """The C decoder's identity where it runs the layers (its bits are its own)."""
        return int8_layer.kernel_identity() if self._c_layers is not None else None

    def _bind_c_layers(self) -> int8_layer.BoundLayers | None:
        """w8a8 on the own int8 kernel, for a model whose layers follow a C recipe: every layer of a
        forward in one C call, for every forward (its bits are not the torch path's)."""
        config, layers = self.model.config, self.decoder.layers
        recipe = C_RECIPES.get(config.model_type)
        activation = C_ACTIVATIONS.get(
            getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        )
        if self.quantization is not precision.W8A8 or recipe is None or activation is None:
            return None
        if own_kernel() is None or self.dtype not in int8_layer.DTYPES or len(layers) != config.num_hidden_layers:
            return None
        kernel = int8_layer.load()
        if kernel is None:
            return None
        rotary = self.decoder.rotary_emb
        self._rope_types = sorted(set(config.layer_types)) if _takes_layer_type(rotary) else [None]
        arguments = self._attention_arguments()
        c_layers = [self._c_layer(i, layer, arguments[i][1]) for i, layer in enumerate(layers)]
        scales, softcaps = {scale for scale, _, _ in arguments}, {softcap for _, _, softcap in arguments}
        products = [p for layer in c_layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if len(scales) != 1 or len(softcaps) != 1 or any(p.compensation is None for p in products):
            return None
        self.products += products
        heads, eps = config.num_attention_heads, config.rms_norm_eps
        c_recipe = int8_layer.Recipe(recipe, activation, scales.pop(), softcaps.pop())
        return kernel.bind(c_layers, self.dtype, heads, self.num_kv_heads, self.head_dim, eps, c_recipe)

    def _attention_arguments(self) -> list[tuple[float, int, float]]:
        """Per layer, the (scale, sliding window or 0, soft-cap or 0) its code passes to the
        attention interface, recorded in a one-token forward of the shadow."""
        probe = _Probe()
        with torch.inference_mode():
            self.decoder(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=False, specdecode_forward=probe)
        return [probe.calls[i] for i in range(len(self.decoder.layers))]

    def _c_layer(self, index: int, layer: nn.Module, window: int) -> int8_layer.Layer:
        attention, mlp = layer.self_attn, layer.mlp
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma: both branches' outputs normalized
        layer_type = self.model.config.layer_types[index] if self._rope_types != [None] else None

        def weight(module: nn.Module | None) -> torch.Tensor | None:
            return None if module is None else module.weight

        return int8_layer.Layer(
            attn_norm=layer.input_layernorm.weight,
            mlp_norm=(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm).weight,
            qkv=_fused_int8([attention.q_proj, attention.k_proj, attention.v_proj], self.dtype),
            o=_fused_int8([attention.o_proj], self.dtype),
            gate_up=_fused_int8([mlp.gate_proj, mlp.up_proj], self.dtype),
            down=_fused_int8([mlp.down_proj], self.dtype),
            attn_out_norm=layer.post_attention_layernorm.weight if sandwich else None,
            mlp_out_norm=layer.post_feedforward_layernorm.weight if sandwich else None,
            q_norm=weight(getattr(attention, "q_norm", None)),
            k_norm=weight(getattr(attention, "k_norm", None)),
            window=window,
            rope=self._rope_types.index(layer_type),
        )

    def _replace_linears(self, root: nn.Module) -> None:
        for module in list(root.modules()):
            for name, child in list(module._modules.items()):
                if type(child) is nn.Linear:
                    product = self._product(child.weight, child.bias, head=False)
                    self.products.append(product)
                    module._modules[name] = _Linear(product, child.out_features)

    def _product(self, weight: torch.Tensor, bias: torch.Tensor | None, head: bool):
        with torch.no_grad():
            if self.quantization is precision.W8A8:
                bias = None if bias is None else bias.to(self.dtype)
                if not head:
                    return int8_projection(weight, bias)
                if own_kernel() is not None:
                    return w8a16_projection(weight, bias)
                return projection(weight, bias, None)
            if head or self.quantization is not precision.INT8_WEIGHT_ONLY:
                return projection(weight, bias, None)
            return projection(weight, bias, precision.INT8_WEIGHT_ONLY)

    def new_cache(self, capacity: int = INITIAL_CAPACITY) -> StaticKVCache:
        return StaticKVCache(
            self.num_layers, self.num_kv_heads, self.head_dim, self.max_length, self.dtype, self.device, capacity
        )

    def _keep_input(self, index: int):
        def hook(module, args, kwargs):
            if index in self._hidden_layers:
                self._kept[index] = (args[0] if args else kwargs["hidden_states"])[0]

        return hook

    def _keep_output(self, module, args, output) -> None:
        if self.num_layers in self._hidden_layers:
            self._kept[self.num_layers] = (output[0] if isinstance(output, tuple) else output)[0]

    def forward(
        self, token_ids: torch.Tensor, num_logits: int, parents: torch.Tensor | None = None
    ) -> torch.Tensor:  # [num_logits, vocab]
        logits = self.forward_batch([self.cache], [token_ids], [num_logits], [parents])[0]
        if self.hidden is not None:
            self.hidden = self.hidden[0]
        return logits

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: list[StaticKVCache],
        token_ids: list[torch.Tensor],  # [n_i] per sequence
        num_logits: list[int],
        parents: list[torch.Tensor | None] | None = None,  # per sequence: [n_i] (a tree) or None (a chain)
    ) -> list[torch.Tensor]:  # [num_logits[i], vocab] per sequence
        """Every sequence's new tokens as the rows of one [1, sum n_i] input: each product runs
        once over all of them; attention runs per sequence over its own cache."""
        parents = [None] * len(caches) if parents is None else parents
        sizes = [int(t.shape[0]) for t in token_ids]
        starts = [0, *itertools.accumulate(sizes)][:-1]
        sequences = [
            self._sequence(cache, start, n, m, p)
            for cache, start, n, m, p in zip(caches, starts, sizes, num_logits, parents)
        ]
        ids = torch.cat(token_ids).to(self.device)[None]  # [1, total]
        positions = torch.cat([s.positions for s in sequences])[None]
        keep = self._hidden_layers
        if self._c_layers is not None:
            x, kept = self._c_forward(ids, positions, sequences)
        else:
            # the layers' hooks write into the dict of the runner that registered them, which a
            # slot (a shallow copy) shares: emptied in place, never replaced
            self._kept.clear()
            forward = _Forward(self._kernel, sequences, sum(sizes))
            x = self.decoder(
                input_ids=ids, position_ids=positions, use_cache=False, specdecode_forward=forward
            ).last_hidden_state[0]  # [total, hidden], after the final norm
            kept = dict(self._kept)
            self._kept.clear()
        self.hidden = list(torch.stack([kept[i] for i in keep], dim=1).split(sizes)) if keep else None
        for s, p in zip(sequences, parents):
            s.cache.advance(s.n, None if p is None else p.tolist())
        last = torch.cat([x[s.start + s.n - m : s.start + s.n] for s, m in zip(sequences, num_logits)])
        logits = self.lm_head(last)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return list(logits.float().cpu().split(num_logits))

    def _c_forward(self, ids: torch.Tensor, positions: torch.Tensor, sequences: list[_Sequence]):
        """The C decoder's forward: (the final norm's output [total, hidden], kept hidden states)."""
        x = self.decoder.embed_tokens(ids)[0].contiguous()  # [total, hidden]
        rotary = self.decoder.rotary_emb
        tables = [rotary(x[None], positions) if t is None else rotary(x[None], positions, t) for t in self._rope_types]
        cos, sin = [c[0].contiguous() for c, _ in tables], [s[0].contiguous() for _, s in tables]
        kept = self._c_layers(
            x, cos, sin, [s.cache for s in sequences], [s.n for s in sequences],
            [(s.contiguous, s.extra) for s in sequences], self._hidden_layers, [s.positions for s in sequences],
        )  # fmt: skip
        return self.decoder.norm(x), kept

    def _sequence(
        self, cache: StaticKVCache, start: int, n: int, num_logits: int, parents: torch.Tensor | None
    ) -> _Sequence:
        cache.reserve(n)
        length = cache.length
        if parents is None:  # a chain (a prefill too): token i sees positions 0 .. length + i
            contiguous = torch.arange(length + 1, length + n + 1, dtype=torch.int32)
            positions = torch.arange(length, length + n)
            return _Sequence(cache, start, n, positions, contiguous, torch.empty(n, 0, dtype=torch.int32))
        positions, contiguous, extra = tree_attention.tree_plan(length, parents, n, num_logits)
        return _Sequence(cache, start, n, positions, contiguous, extra)

    def _copied_modules(self):
        for layer in self.model.base_model.layers:
            yield from (m for m in layer.modules() if type(m) is nn.Linear)
        head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if head.weight is not embedding.weight:
            yield head
