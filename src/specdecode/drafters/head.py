"""A draft head trained for its target (EAGLE, Li et al. 2024; EAGLE-3's fused features; FR-Spec's
reduced vocabulary, Zhao et al. 2025): `--drafter head --draft DIR`.

The head is one decoder layer over the target's own hidden states. Row j of its input is
fc(concat(embedding of token j + 1, h_j)), where h_j is the target's feature at position j (the
hidden states of `feature_layers`, fused by a Linear when there are several) or, past the tokens
the target has run, the head's own output of the row before (each of the two through an RMS norm
of its own first, in heads with `input_norms`); the layer's output g goes through
the target's final norm to a reduced output vocabulary: the rows of the target's output head
for the `draft_vocab_size` tokens most frequent in the training answers (end of sequence
included). The embedding, the norm and those rows are the target's, frozen: a head directory
holds only what was trained (`save_head`, `load_head`).

Exactness. The head's q is the softmax over its vocabulary, zero elsewhere: a token it cannot
propose has q = 0, so the accept/reject rule stays exact when sampling (core/verification.py),
and greedy drafts are argmaxes, verified like any other. Its features are the target's hidden
states of tokens already accepted, delivered after each verification by the decoder
(`learn_hidden`): never anything of the step being verified.

Which target. A head's config records the fingerprint of the target it was trained on
(`target_fingerprint`): a head is loaded only for that target (`load_head`), and `auto` drafts
with the head shipped in the package for its target (`shipped_head`, in specdecode/heads/).
A head for another target would draft correctly, since drafts are verified, but uselessly.

Cache. The head keeps its own small KV cache: rows computed from the target's features are kept
(and cropped when the sequence's tokens change under them), rows computed from its own outputs
(the draft) are dropped at the next proposal, as the target's rejected drafts are.

Trees (`tree=True`, for a target that verifies trees), drafted as EAGLE-2 does: level by
level, the `branching` frontier nodes most likely reached offer their `branching` most probable
children, all of a level in one head forward (each node attends to the prefix, its ancestors
and itself); the draft is the k offered nodes most likely reached. The tree is the same at every
temperature: a function of the context, one-hot, so the tree rule keeps the target's law when
sampling too (core/verification.py). Sampled, trees beat the head's chains drawn from q
(whose head forwards run one after another) at temperatures 0.7 and 1
(benchmarks/results/sampling-head-trees.md).
"""

from __future__ import annotations

import copy
import hashlib
import heapq
import json
import math
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from specdecode.core.sampling import SamplingParams, logits_to_probs, sample
from specdecode.drafters.base import Draft, Drafter
from specdecode.drafters.head_kernel import KernelLayer, kernel_layer
from specdecode.drafters.tree import TreeBuilder
from specdecode.errors import InvalidArgumentError
from specdecode.kernels import int8_layer
from specdecode.runners.cached import common_prefix_length
from specdecode.runners.projection import W8A16Projection, own_kernel, projection, w8a16_projection

HEAD_CONFIG, HEAD_WEIGHTS, HEAD_VOCABULARY = "config.json", "head.safetensors", "vocabulary.json"
SHIPPED_HEADS = Path(__file__).resolve().parents[1] / "heads"  # package data: one folder per head
FINGERPRINT_ROWS = 8  # input embedding and output head rows hashed, spread over the vocabulary
TREE_BRANCHING = 4  # children offered per expanded node, and nodes expanded per level


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    feature_layers: tuple[int, ...]  # the target's hidden states it reads (runner.hidden_layers)
    num_target_layers: int
    target_vocab_size: int
    draft_vocab_size: int
    training: dict = field(default_factory=dict)  # how it was trained: loss, steps, data (informational)
    target_fingerprint: str = ""  # the target it was trained on (target_fingerprint); "": not recorded
    target_name: str = ""  # that target's name, for messages
    # RMS norms (trained weights) on the token embedding and on the features before fc, as
    # EAGLE-3's layer has: a target whose features run far larger than its embeddings (Gemma 3's
    # last layer: RMS ~1,200, single channels ~30,000) otherwise swamps fc. False: heads saved
    # before it, which have none.
    input_norms: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> HeadConfig:
        values = json.loads(text)
        values["feature_layers"] = tuple(values["feature_layers"])
        return HeadConfig(**values)


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high features: entering layers 2, L/2 and L - 3 (distinct, in range)."""
    return tuple(sorted({min(2, num_layers), num_layers // 2, max(0, num_layers - 3)}))


def head_config(
    model: PreTrainedModel,
    feature_layers: tuple[int, ...],
    draft_vocab_size: int,
    target_name: str | None = None,
    input_norms: bool = True,
) -> HeadConfig:
    """A head shaped as one of the target's decoder layers, for this target (its fingerprint;
    target_name: what to call it in messages, by default its folder's name; input_norms:
    HeadConfig's)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta", 1e4)
    layers = config.num_hidden_layers
    if not feature_layers or any(not 0 <= i <= layers for i in feature_layers):
        raise InvalidArgumentError(f"feature layers must be in 0..{layers}, got {feature_layers}", "feature_layers")
    return HeadConfig(
        hidden_size=config.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope),
        feature_layers=tuple(sorted(feature_layers)),
        num_target_layers=layers,
        target_vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        draft_vocab_size=draft_vocab_size,
        target_fingerprint=target_fingerprint(model),
        target_name=target_name or Path(str(getattr(model.config, "name_or_path", "") or "")).name,
        input_norms=input_norms,
    )


def target_fingerprint(model: PreTrainedModel) -> str:
    """Which target this is, cheaply and exactly: its text config's shapes and the bytes of a few
    input embedding and output head rows and of the final norm, rounded to bfloat16 first, so
    that float32 and bfloat16 loads of one model (from its .gguf or a converted folder) agree.
    Another model, or a fine-tune of the same shapes whose embeddings moved, differs. (A float16
    load may not agree: rounding twice can land elsewhere.)"""
    config = model.config.get_text_config()
    embed, norm = target_parts(model)
    output = model.get_output_embeddings().weight
    shapes = [
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None),
        config.intermediate_size,
        list(embed.shape),
        list(output.shape),
    ]
    rows = torch.linspace(0, embed.shape[0] - 1, FINGERPRINT_ROWS).long()
    digest = hashlib.blake2b(json.dumps(shapes).encode(), digest_size=16)
    for tensor in (embed[rows.to(embed.device)], output[rows.to(output.device)], norm):
        digest.update(tensor.detach().to("cpu", torch.bfloat16).contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def target_parts(model: PreTrainedModel) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [vocab, hidden] and final norm weight [hidden], as they are."""
    base = model.base_model
    norm = getattr(base, "norm", None)
    if norm is None or getattr(norm, "weight", None) is None:
        raise InvalidArgumentError(
            f"the draft head needs a Llama-family target (an RMS final norm), not {model.config.model_type}", "target"
        )
    return model.get_input_embeddings().weight, norm.weight


def final_norm_weight(model: PreTrainedModel) -> torch.Tensor:
    """The target's final norm as the weight the head multiplies a normalized row by: its weight
    (Llama's RMSNorm), or 1 + weight (Gemma's RMSNorm scales by that, its weight stored as an
    offset from 1), told apart by running the norm on a row of ones. Either way the head's
    logits through it are the target's (on the head's vocabulary)."""
    _, weight = target_parts(model)
    probe = torch.ones(1, weight.shape[0], device=weight.device)
    with torch.no_grad():
        normed = model.base_model.norm(probe).float()[0] * (1 + model.config.get_text_config().rms_norm_eps) ** 0.5
    shifted = 1 + weight.detach().float()
    if (normed - shifted).abs().max() < (normed - weight.detach().float()).abs().max():
        return shifted
    return weight


class DraftHead(nn.Module):
    """The trained module; the target's embedding, final norm and head rows are frozen buffers."""

    def __init__(
        self,
        config: HeadConfig,
        embed: torch.Tensor,  # [target vocab, hidden], the target's input embedding
        norm: torch.Tensor,  # [hidden], the target's final norm weight
        head_rows: torch.Tensor,  # [draft vocab, hidden], the target's output head rows of `vocabulary`
        vocabulary: torch.Tensor,  # [draft vocab] int64, target token ids
    ):
        super().__init__()
        self.config = config
        hidden, fused = config.hidden_size, len(config.feature_layers)
        # frozen and never saved: a head directory holds what was trained
        self.register_buffer("embed", embed.detach(), persistent=False)
        self.register_buffer("norm", norm.detach().float(), persistent=False)
        self.register_buffer("head_rows", head_rows.detach().float(), persistent=False)
        self.register_buffer("vocabulary", vocabulary.long(), persistent=False)
        self.fuse = nn.Linear(fused * hidden, hidden, bias=False) if fused > 1 else None
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        if config.input_norms:
            self.embed_norm = nn.Parameter(torch.ones(hidden))
            self.feature_norm = nn.Parameter(torch.ones(hidden))
        self.layer = HeadLayer(config)
        self.rows_product: Callable[[torch.Tensor], torch.Tensor] | None = None  # for_drafting's head rows
        self.kernel_layer: KernelLayer | None = None  # for_drafting's layer in C (drafters/head_kernel.py)
        self.token_embedding: Callable[[torch.Tensor], torch.Tensor] | None = None  # read_embeddings_from

    def read_embeddings_from(self, embedding: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look tokens up through `embedding` ([n] int64 -> [n, hidden]: a w8a8 target's, read from
        its head's int8 codes) and drop the buffer of the target's embedding matrix, which the
        target then frees. The head drafts from other inputs than it was trained on (an 8-bit
        rounding of them); its drafts are verified whatever they are."""
        self.token_embedding = embedding
        del self.embed

    def features(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        """The target's hidden states [n, len(feature_layers), hidden] as one feature per row."""
        hidden = hidden.float()
        return hidden[:, 0] if self.fuse is None else self.fuse(hidden.flatten(1))

    def forward(
        self,
        features: torch.Tensor,  # [n, hidden] h_j: fused target features, or the head's own outputs
        tokens: torch.Tensor,  # [n] int64, token j + 1 of each row
        positions: torch.Tensor,  # [n] int64
        past: tuple[torch.Tensor, torch.Tensor] | None,  # keys, values [kv heads, c, head_dim]
        mask: torch.Tensor | None,  # [n, c + n] bool, True: attends; None: causal over the n rows
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # g [n, hidden], keys, values [kv, n, d]
        return self.layer(self._mix(features, tokens), positions, past, mask)

    def draft_forward(
        self,
        features: torch.Tensor,  # [n, hidden], as forward's
        tokens: torch.Tensor,  # [n] int64
        positions: torch.Tensor,  # [n] int64
        cache: HeadCache,  # the rows before these: their keys and values are appended to it
        mask: torch.Tensor | None,  # [n, cache.length + n] bool; None: causal
    ) -> torch.Tensor:  # g [n, hidden]
        """forward for drafting, on the C layer where for_drafting made one."""
        x = self._mix(features, tokens)
        if self.kernel_layer is not None:
            return self.kernel_layer(x, positions, cache, mask)
        g, keys, values = self.layer(x, positions, cache.past(), mask)
        cache.append(keys, values)
        return g

    def _mix(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # the layer's input [n, hidden]
        embedded = (self.embed[tokens] if self.token_embedding is None else self.token_embedding(tokens)).float()
        if self.config.input_norms:
            eps = self.config.rms_norm_eps
            embedded, features = _rms_norm(embedded, self.embed_norm, eps), _rms_norm(features, self.feature_norm, eps)
        return self.fc(torch.cat([embedded, features], dim=-1))

    def logits(self, g: torch.Tensor) -> torch.Tensor:  # [n, draft vocab]
        """Over the head's vocabulary, through the target's final norm."""
        normed = _rms_norm(g, self.norm, self.config.rms_norm_eps)
        return normed @ self.head_rows.T if self.rows_product is None else self.rows_product(normed)


class HeadLayer(nn.Module):
    """A Llama decoder layer (pre-norm attention with rope, gated SiLU MLP) on one sequence."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.config = config
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.q = nn.Linear(hidden, config.num_heads * d, bias=False)
        self.k = nn.Linear(hidden, config.num_kv_heads * d, bias=False)
        self.v = nn.Linear(hidden, config.num_kv_heads * d, bias=False)
        self.o = nn.Linear(config.num_heads * d, hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.gate = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.up = nn.Linear(hidden, config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, hidden, bias=False)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # for_drafting's products of q|k|v and gate|up, each one call instead of three and two
        # (a head forward of a few rows is mostly per-call cost); None on the trained layer
        self.qkv: nn.Module | None = None
        self.gate_up: nn.Module | None = None

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden]
        positions: torch.Tensor,  # [n]
        past: tuple[torch.Tensor, torch.Tensor] | None,  # [kv, c, d] each
        mask: torch.Tensor | None,  # [n, c + n] bool; None: causal
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, n = self.config, x.shape[0]
        h = _rms_norm(x, self.attn_norm, c.rms_norm_eps)
        q, k, v = self._qkv(h)
        q = q.reshape(n, c.num_heads, c.head_dim).transpose(0, 1)  # [heads, n, d]
        k = k.reshape(n, c.num_kv_heads, c.head_dim).transpose(0, 1)  # [kv, n, d]
        v = v.reshape(n, c.num_kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = self._rotation(positions)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys = k if past is None else torch.cat([past[0], k], dim=1)
        values = v if past is None else torch.cat([past[1], v], dim=1)
        if mask is None:
            mask = torch.ones(n, keys.shape[1], dtype=torch.bool).tril(keys.shape[1] - n)
        out = _grouped_attention(q, keys, values, mask)  # [heads, n, d]
        x = x + self.o(out.transpose(0, 1).reshape(n, -1))
        m = _rms_norm(x, self.mlp_norm, c.rms_norm_eps)
        if self.gate_up is None:
            gate, up = self.gate(m), self.up(m)
        else:
            gate, up = self.gate_up(m).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), k, v

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, ...]:  # q [n, heads * d], k and v [n, kv * d]
        if self.qkv is None:
            return self.q(h), self.k(h), self.v(h)
        c = self.config
        return self.qkv(h).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1
        )

    def _rotation(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [n, d]
        """Rotary cos and sin at positions, from a table computed once per length (a head
        forward of a few rows is mostly per-operation cost: this saves six operations)."""
        end = int(positions.max()) + 1 if positions.numel() else 0
        table = self.__dict__.get("_rotations")
        if table is None or table[0].shape[0] < end:
            angles = torch.arange(max(end, 2 * (0 if table is None else table[0].shape[0]), 256)).float()
            angles = angles[:, None] * self.inv_freq[None]  # [positions, d / 2]
            table = (torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin())
            self.__dict__["_rotations"] = table  # not a buffer: never saved, never a parameter
        return table[0][positions], table[1][positions]


def _grouped_attention(
    q: torch.Tensor,  # [heads, n, d]
    keys: torch.Tensor,  # [kv heads, c, d]
    values: torch.Tensor,  # [kv heads, c, d]
    mask: torch.Tensor,  # [n, c] bool, True: attends
) -> torch.Tensor:  # [heads, n, d]
    """Softmax attention with grouped key/value heads (query head h reads kv head h // group, as
    scaled_dot_product_attention's enable_gqa): one product per kv head for all its query heads,
    without copying keys and values for each query head."""
    heads, n, d = q.shape
    kv, c = keys.shape[0], keys.shape[1]
    group = heads // kv
    scores = torch.matmul(q.reshape(kv, group * n, d), keys.transpose(1, 2)).view(kv, group, n, c) * d**-0.5
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.matmul(weights.view(kv, group * n, c), values).view(heads, n, d)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of x [heads, n, d]; cos, sin [n, d]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _Product(nn.Module):
    """A frozen Linear's product on a runners.projection kernel (for_drafting)."""

    def __init__(self, weight: torch.Tensor):  # [out, in]
        super().__init__()
        self.product = drafting_product(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] float32 -> [n, out] float32
        return self.product(x)


def drafting_product(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:  # weight [out, in]
    """The fastest product this CPU has for a head's frozen weight: the w8a16 kernel (int8
    weights, 16-bit row-scaled activations) where it runs, else float32 reordered for oneDNN.
    Either is a deterministic function of its input, which is all a drafter needs: its drafts
    (and their q, when sampling) are verified, whatever it computes."""
    weight = weight.detach().float()
    kernel = own_kernel()
    if kernel is not None and kernel.packs((weight.shape[0], weight.shape[1])):
        return w8a16_projection(weight, None)
    return projection(weight.contiguous(), None, None)


def drafting_kind(fast: DraftHead) -> str:
    """What a for_drafting copy computes with ("w8a16", "float32", or both where the kernel
    packs some shapes and not others; and the C layer's identity where its layer runs there):
    HeadDrafter.cache_identity names it."""
    products = [m.product for m in fast.modules() if isinstance(m, _Product)] + [fast.rows_product]
    kinds = {"w8a16" if isinstance(p, W8A16Projection) else "float32" for p in products}
    if fast.kernel_layer is not None:
        kinds.add(int8_layer.kernel_identity())
    return "+".join(sorted(kinds))


def for_drafting(head: DraftHead, layer_in_c: bool = True) -> DraftHead:
    """A frozen copy of head that drafts several times faster: its layer in one C call where the
    C decoder layers run (drafters/head_kernel.py), else on drafting_product, and the other
    products on drafting_product (nn.Linear's float32 products make a one-row head forward several
    times slower: benchmarks/results/draft-head-products.md). The trained head is left as it
    is (training and saving use it); the frozen buffers are shared. layer_in_c=False keeps the
    layer on torch operations (benchmarks/head.py compares the two)."""
    fast = copy.copy(head)  # a shallow copy: its own module table below, the buffers shared
    fast._modules = dict(head._modules)
    fast._parameters = {name: nn.Parameter(p.detach().clone(), False) for name, p in head._parameters.items()}
    fast.layer = copy.copy(head.layer)
    fast.layer._modules = dict(head.layer._modules)
    fast.layer._parameters = {
        name: nn.Parameter(p.detach().clone(), False) for name, p in head.layer._parameters.items()
    }
    with torch.no_grad():
        for name in ("fuse", "fc"):
            if getattr(fast, name) is not None:
                setattr(fast, name, _Product(getattr(fast, name).weight))
        fast.rows_product = drafting_product(head.head_rows)
    fast.kernel_layer = kernel_layer(head.layer, fast.layer._rotation) if layer_in_c else None
    if fast.kernel_layer is None:
        _drafting_layer(fast.layer, head.layer)
    return fast.eval()


@torch.no_grad()
def _drafting_layer(fast: HeadLayer, trained: HeadLayer) -> None:
    """fast (a copy of trained) on drafting products, q|k|v and gate|up fused (w8a16 codes and
    scales are per output channel: fused, the same bits)."""
    for name in ("o", "down"):
        setattr(fast, name, _Product(getattr(trained, name).weight))
    fast.qkv = _Product(torch.cat([trained.q.weight, trained.k.weight, trained.v.weight]))
    fast.gate_up = _Product(torch.cat([trained.gate.weight, trained.up.weight]))


def new_head(model: PreTrainedModel, config: HeadConfig, vocabulary: torch.Tensor, seed: int) -> DraftHead:
    """An untrained head for model over vocabulary [draft vocab] (target token ids), seeded."""
    embed, norm = target_parts(model)[0], final_norm_weight(model)
    rows = model.get_output_embeddings().weight[vocabulary]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DraftHead(config, embed, norm, rows, vocabulary)


def save_head(head: DraftHead, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    """config.json, head.safetensors (the trained weights) and vocabulary.json (target ids).
    dtype: the weights' dtype in the file (torch.bfloat16 halves it; load_head converts them
    back to the float32 the head computes in); None: as they are."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HEAD_CONFIG).write_text(head.config.to_json())
    weights = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in head.state_dict().items()}
    save_file(weights, folder / HEAD_WEIGHTS)
    (folder / HEAD_VOCABULARY).write_text(json.dumps(head.vocabulary.tolist()))


def is_head_folder(path: object) -> bool:
    """Whether path is a folder save_head wrote (a draft head, not a draft model)."""
    if not isinstance(path, (str, Path)) or not (Path(path) / HEAD_CONFIG).is_file():
        return False
    try:
        return "feature_layers" in json.loads((Path(path) / HEAD_CONFIG).read_text())
    except (OSError, ValueError):
        return False


def shipped_head(model: PreTrainedModel | None, heads: str | Path | None = None) -> Path | None:
    """The folder of the head trained for this target among those in heads (default: the
    package's, SHIPPED_HEADS): the one whose config records this target's fingerprint; None
    if there is none."""
    heads = Path(SHIPPED_HEADS if heads is None else heads)
    if model is None or not heads.is_dir():
        return None
    try:
        fingerprint = target_fingerprint(model)
    except InvalidArgumentError:  # no Llama-family target: no head drafts for it
        return None
    for folder in sorted(heads.iterdir()):
        if is_head_folder(folder) and _config(folder).target_fingerprint == fingerprint:
            return folder
    return None


def _config(folder: Path) -> HeadConfig:
    return HeadConfig.from_json((folder / HEAD_CONFIG).read_text())


def load_head(folder: str | Path, model: PreTrainedModel) -> DraftHead:
    """A head saved by save_head, for this target (its embedding, norm and head rows). A head
    that records another target's fingerprint is refused; one that records none (saved before
    heads recorded it) loads if its shapes fit."""
    folder = Path(folder)
    if not (folder / HEAD_CONFIG).is_file():
        raise InvalidArgumentError(f"{folder} holds no draft head ({HEAD_CONFIG} missing): train one", "draft")
    config = _config(folder)
    embed, norm = target_parts(model)[0], final_norm_weight(model)
    if tuple(embed.shape) != (config.target_vocab_size, config.hidden_size):
        raise InvalidArgumentError(
            f"the head in {folder} was trained for a target of vocabulary {config.target_vocab_size} and hidden "
            f"size {config.hidden_size}, not {tuple(embed.shape)}",
            "draft",
        )
    if config.target_fingerprint and config.target_fingerprint != target_fingerprint(model):
        trained_for = f"'{config.target_name}'" if config.target_name else "another target"
        raise InvalidArgumentError(
            f"the head in {folder} was trained for {trained_for} (fingerprint {config.target_fingerprint}), not for "
            f"this target ({target_fingerprint(model)}): train one for it with specdecode train-draft",
            "draft",
        )
    vocabulary = torch.tensor(json.loads((folder / HEAD_VOCABULARY).read_text()), dtype=torch.long)
    head = DraftHead(config, embed, norm, model.get_output_embeddings().weight[vocabulary], vocabulary)
    head.load_state_dict(load_file(folder / HEAD_WEIGHTS))  # copied into the head's float32 weights
    return head.eval()


# a head's digest, computed once per state of its weights (it reads every weight)
_head_digests: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_digest(head: DraftHead) -> str:
    """What a head's drafts depend on besides its target: its trained weights' bytes (what
    head.safetensors holds, as the head computes with them), its vocabulary and its config
    (how it was trained and the target's name left out). Read again after the weights change."""
    state = sorted(head.state_dict().items())
    versions = tuple(tensor._version for _, tensor in state)  # bumped by every in-place update
    known = _head_digests.get(head)
    if known is not None and known[0] == versions:
        return known[1]
    config = {k: v for k, v in asdict(head.config).items() if k not in ("training", "target_name")}
    digest = hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=16)
    for name, tensor in state:
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    digest.update(head.vocabulary.cpu().contiguous().numpy().tobytes())
    _head_digests[head] = (versions, digest.hexdigest())
    return digest.hexdigest()


class HeadCache:
    """The head's keys and values [kv heads, capacity, head_dim], grown by doubling; a crop sets
    length. A list of one layer's each, as the C layer takes a cache (head_kernel.LayerCache)."""

    def __init__(self, config: HeadConfig, capacity: int = 256):
        shape = (config.num_kv_heads, capacity, config.head_dim)
        self.keys, self.values, self.length = [torch.empty(shape)], [torch.empty(shape)], 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def past(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[0][:, : self.length], self.values[0][:, : self.length]

    def reserve(self, rows: int) -> None:
        """Room for `rows` more rows."""
        end = self.length + rows
        if end > self.capacity:
            self.keys, self.values = ([_grown(t[0], self.length, end)] for t in (self.keys, self.values))

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:  # [kv, n, d]
        self.reserve(keys.shape[1])
        end = self.length + keys.shape[1]
        self.keys[0][:, self.length : end] = keys
        self.values[0][:, self.length : end] = values
        self.length = end


def _grown(tensor: torch.Tensor, used: int, needed: int, dim: int = 1) -> torch.Tensor:
    """tensor with room for `needed` entries along dim (at least double), its first `used` kept."""
    shape = list(tensor.shape)
    shape[dim] = max(2 * shape[dim], needed, 64)
    grown = tensor.new_empty(shape)
    grown.narrow(dim, 0, used).copy_(tensor.narrow(dim, 0, used))
    return grown


class HeadDrafter(Drafter):
    """Drafts with a DraftHead from the target's hidden states of the accepted tokens
    (`hidden_layers`, which the decoder asks the target's runner for, and delivers through
    `learn_hidden`). A sequence whose features are missing (a runner that keeps none) gets no
    drafts. Each sequence has a state of its own (fork), the weights shared."""

    name = "head"
    per_sequence = True
    depends_on_history = False  # drafts depend on the sequence alone (its tokens and their features)

    def __init__(
        self, head: DraftHead, tree: bool = False, branching: int = TREE_BRANCHING, fast: DraftHead | None = None
    ):
        """tree: draft trees, one-hot, greedy or sampled (module docstring), else chains (drawn
        from q when sampling); fast: head's for_drafting copy, if made already (forks share it)."""
        self.head = head.eval()
        self.fast = fast if fast is not None else for_drafting(head)  # what drafts: the head's weights as they are now
        self.hidden_layers = head.config.feature_layers
        self.drafts_trees = tree
        self.branching = branching
        self.begin([])

    def fork(self) -> HeadDrafter:
        return HeadDrafter(self.head, self.drafts_trees, self.branching, self.fast)

    def cache_identity(self) -> list:
        """What its drafts depend on besides the target's hidden states (the target the response
        cache keys by already): the head (head_digest) and how it drafts."""
        embedding = "the embedding matrix" if self.fast.token_embedding is None else "the target's embedding function"
        return [head_digest(self.head), self.drafts_trees, self.branching, drafting_kind(self.fast), embedding]

    def begin(self, prompt_ids: list[int]) -> None:
        c = self.head.config
        self._features = torch.empty(0, len(c.feature_layers), c.hidden_size)  # [positions, layers, hidden]
        self._known = 0  # positions whose target features have been delivered
        self._cache = HeadCache(c)
        self._rows_tokens: list[int] = []  # the tokens the cache's rows were computed from
        self._true = 0  # leading cache rows computed from target features (the rest: a draft)

    def learn_hidden(self, start: int, hidden: torch.Tensor) -> None:
        """The target's hidden states [m, len(hidden_layers), hidden] at positions start .. start + m - 1."""
        end = start + hidden.shape[0]
        if start > self._known:
            return  # a gap (features missed): nothing to draft from until the sequence restarts
        if end > self._features.shape[0]:
            self._features = _grown(self._features, start, end, dim=0)
        self._features[start:end] = hidden.float()
        self._known = end
        self._true = min(self._true, start)  # rows that read a rewritten feature are computed again

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        pass  # the cache rolls itself back on the next proposal

    def learn(self, token_ids: list[int], draft: Draft, logits: torch.Tensor) -> None:
        pass

    def finish(self, token_ids: list[int]) -> None:
        pass

    @torch.inference_mode()
    def propose(self, token_ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        n = len(token_ids)
        if k <= 0 or n < 2 or self._known < n - 1:
            return Draft.empty()
        g = self._catch_up(token_ids)  # [1, hidden], the head's output after the root
        if self.drafts_trees:
            return self._tree(token_ids, g, k)
        return self._chain(token_ids, g, k, params, generator)

    def _catch_up(self, token_ids: list[int]) -> torch.Tensor:  # [1, hidden]
        """Rows 0 .. n - 2 from the target's features (row j: feature j and token j + 1), those
        not in the cache run now; the last always runs, for its output."""
        n = len(token_ids)
        keep = min(self._true, common_prefix_length(self._rows_tokens, token_ids) - 1, n - 2)
        keep = max(keep, 0)
        self._cache.length = keep
        rows = torch.arange(keep, n - 1)
        features = self.fast.features(self._features[keep : n - 1])
        tokens = torch.tensor(token_ids[keep + 1 : n], dtype=torch.long)
        g = self.fast.draft_forward(features, tokens, rows, self._cache, None)
        self._rows_tokens, self._true = list(token_ids), n - 1
        return g[-1:]

    def _chain(
        self, token_ids: list[int], g: torch.Tensor, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        position = len(token_ids) - 1
        for i in range(k):
            q = self._q(self.fast.logits(g)[0], params)  # [target vocab]
            tokens.append(int(sample(q, generator)) if not params.greedy else int(q.argmax()))
            probs.append(q)
            if i + 1 < k:
                row = torch.tensor([tokens[-1]])
                g = self.fast.draft_forward(g, row, torch.tensor([position]), self._cache, None)
                position += 1
        return Draft(torch.tensor(tokens, dtype=torch.long), None if params.greedy else torch.stack(probs))

    def _q(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:  # [target vocab]
        """q over the target's vocabulary: the head's processed distribution, zero off its vocabulary."""
        full = torch.full((self.head.config.target_vocab_size,), -math.inf)
        full[self.head.vocabulary] = logits
        return logits_to_probs(full, params)

    def _tree(self, token_ids: list[int], g_root: torch.Tensor, k: int) -> Draft:
        """Up to k nodes (module docstring): one head forward per level, over the nodes it expands."""
        offered: list[_Node] = []
        frontier = self._offer([None], g_root, offered)
        true_rows = self._cache.length
        for _ in range(k - 1):  # no node deeper than k can be among the k most likely
            cutoff = heapq.nlargest(k, offered)[-1] if len(offered) >= k else None
            expand = [n for n in heapq.nlargest(self.branching, frontier) if cutoff is None or n > cutoff]
            if not expand:
                break
            outputs = self._expand(expand, g_root[0], len(token_ids) - 2, true_rows)
            frontier = self._offer(expand, outputs, offered)
        chosen = sorted(heapq.nlargest(k, offered), reverse=True)  # most likely first: parents before children
        builder, placed = TreeBuilder(k), {}
        for node in chosen:
            placed[node.order] = builder.child(-1 if node.parent is None else placed[node.parent.order], node.token)
        return builder.draft()

    def _expand(self, nodes: list[_Node], g_root: torch.Tensor, root_row: int, true_rows: int) -> torch.Tensor:
        """Run the rows of these nodes (each: its parent's output and its token) in one forward,
        each seeing the target-feature rows, its ancestors' rows and itself; their outputs
        [len(nodes), hidden]."""
        start = self._cache.length
        features = torch.stack([g_root if n.parent is None else n.parent.output for n in nodes])
        tokens = torch.tensor([n.token for n in nodes])
        positions = torch.tensor([root_row + n.depth for n in nodes])
        mask = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)
        mask[:, :true_rows] = True
        for i, node in enumerate(nodes):
            ancestor = node.parent
            while ancestor is not None:
                mask[i, ancestor.row] = True
                ancestor = ancestor.parent
            mask[i, start + i] = True
            node.row = start + i
        g = self.fast.draft_forward(features, tokens, positions, self._cache, mask)
        for node, output in zip(nodes, g):
            node.output = output
        return g

    def _offer(self, nodes: list[_Node | None], g: torch.Tensor, offered: list[_Node]) -> list[_Node]:
        """The `branching` most probable children of each node (None: the root), whose outputs
        are g [len(nodes), hidden], offered node by node: one logits product for a level."""
        probs = torch.softmax(self.fast.logits(g), -1)  # [nodes, draft vocab]
        top = probs.topk(min(self.branching, probs.shape[-1]), dim=-1)
        children = []
        for node, chances, tokens in zip(nodes, top.values.tolist(), self.head.vocabulary[top.indices].tolist()):
            chance, depth = (1.0, 1) if node is None else (node.chance, node.depth + 1)
            children += [
                _Node(chance * p, len(offered) + len(children) + i, t, node, depth)
                for i, (p, t) in enumerate(zip(chances, tokens))
            ]
        offered.extend(children)
        return children


@dataclass(eq=False)
class _Node:
    """An offered child; "larger" when more likely reached, or as likely and offered earlier."""

    chance: float  # the product of the head's probabilities along its path
    order: int  # offered as the order-th
    token: int
    parent: _Node | None  # None: a child of the root
    depth: int
    row: int = -1  # its row in the head's cache, once expanded
    output: torch.Tensor | None = None  # [hidden], the head's output at its row, once expanded

    def __lt__(self, other: _Node) -> bool:
        return (self.chance, -self.order) < (other.chance, -other.order)
