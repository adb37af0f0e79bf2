"""A lean forward pass for GPT-2 models (gpt2, distilgpt2, gpt2-medium, ...).

The GPT-2 counterpart of fast_llama.py: transformers' weights and arithmetic, a static KV
cache with in-place rollback, logits only where asked, and in half precision on the CPU
exact verification (one query at a time, attention.py; oneDNN products, projection.py).
GPT-2 stores its projections as Conv1D, [in, out]; a Projection of the transposed view
runs the same `addmm` with the bias fused in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specdecode.runners.attention import attend, per_query_by_default
from specdecode.runners.projection import Projection, projection
from specdecode.runners.static_cache import StaticCacheRunner, StaticKVCache

INITIAL_CAPACITY = 1024


def supports(model: PreTrainedModel) -> bool:
    config = model.config
    return config.model_type == "gpt2" and not config.add_cross_attention and not config.reorder_and_upcast_attn


@dataclass
class _Block:
    ln_1: tuple[torch.Tensor, torch.Tensor]  # weight, bias [hidden]
    c_attn: Projection  # hidden -> 3 * hidden
    attn_proj: Projection  # hidden -> hidden
    ln_2: tuple[torch.Tensor, torch.Tensor]
    c_fc: Projection  # hidden -> inner
    mlp_proj: Projection  # inner -> hidden
    scale: float  # attention scaling, per layer when scale_attn_by_inverse_layer_idx


class FastGPT2Runner(StaticCacheRunner):
    """One sequence at a time, on the model's device and dtype."""

    def __init__(self, model: PreTrainedModel):
        if not supports(model):
            raise ValueError(f"FastGPT2Runner does not support this {model.config.model_type} model")
        config, transformer = model.config, model.transformer
        self.model = model
        self.num_heads = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.eps = config.layer_norm_epsilon
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(config.n_positions)
        self.device, self.dtype = model.device, model.dtype
        self.wte, self.wpe = transformer.wte.weight, transformer.wpe.weight
        self.ln_f = (transformer.ln_f.weight, transformer.ln_f.bias)
        self.lm_head = projection(model.get_output_embeddings().weight, None, None)
        self.act = transformer.h[0].mlp.act  # transformers' own activation (gelu_new for GPT-2)
        self.blocks = [_block(block) for block in transformer.h]
        self.per_query_attention = per_query_by_default(self.dtype, self.device)
        self.cache = StaticKVCache(
            len(self.blocks), self.num_heads, self.head_dim, self.max_length, self.dtype, self.device, INITIAL_CAPACITY
        )

    def _copied_modules(self):
        # GPT-2's head is tied to its token embedding, which stays
        for module, fused in zip(self.model.transformer.h, self.blocks):
            pairs = ((module.attn.c_attn, fused.c_attn), (module.attn.c_proj, fused.attn_proj))
            pairs += ((module.mlp.c_fc, fused.c_fc), (module.mlp.c_proj, fused.mlp_proj))
            yield from (m for m, p in pairs if p.is_copy)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, num_logits: int, parents: torch.Tensor | None = None) -> torch.Tensor:
        if parents is not None:
            raise ValueError("FastGPT2Runner does not verify trees (verifies_trees is False): pass parents=None")
        start, n = self.cache.length, token_ids.shape[0]
        self.cache.reserve(n)
        positions = torch.arange(start, start + n, device=self.device)
        x = F.embedding(token_ids.to(self.device), self.wte) + F.embedding(positions, self.wpe)  # [n, hidden]
        # verification (every new token's logits wanted) in half precision: each query alone
        mask = None if self.per_query_attention and num_logits == n else self.cache.causal_mask(n)
        for i, block in enumerate(self.blocks):
            x = x + self._attention(i, block, F.layer_norm(x, x.shape[-1:], *block.ln_1, self.eps), mask)
            x = x + block.mlp_proj(self.act(block.c_fc(F.layer_norm(x, x.shape[-1:], *block.ln_2, self.eps))))
        self.cache.advance(n)
        x = F.layer_norm(x[-num_logits:], x.shape[-1:], *self.ln_f, self.eps)
        return self.lm_head(x).float().cpu()  # [num_logits, vocab]

    def _attention(
        self,
        index: int,
        block: _Block,
        h: torch.Tensor,  # [n, hidden]
        mask: torch.Tensor | None,  # [n, cached + n] bool; None: each query alone
    ) -> torch.Tensor:  # [n, hidden]
        n, hidden = h.shape
        q, k, v = (
            block.c_attn(h).view(n, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3)
        )  # each [heads, n, head_dim]
        keys, values = self.cache.write(index, k, v)
        out = attend(q, keys, values, mask, block.scale)  # [heads, n, head_dim]
        return block.attn_proj(out.transpose(0, 1).reshape(n, hidden))


def _block(block: torch.nn.Module) -> _Block:
    def pair(module):  # the parameters themselves (release_model_weights moves them)
        return module.weight, module.bias

    def conv1d(module):  # Conv1D holds W as [in, out]
        return projection(module.weight.t(), module.bias, None)

    return _Block(
        ln_1=pair(block.ln_1),
        c_attn=conv1d(block.attn.c_attn),
        attn_proj=conv1d(block.attn.c_proj),
        ln_2=pair(block.ln_2),
        c_fc=conv1d(block.mlp.c_fc),
        mlp_proj=conv1d(block.mlp.c_proj),
        scale=block.attn.scaling,
    )
