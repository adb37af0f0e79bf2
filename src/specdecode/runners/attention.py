"""SDPA over a sequence's cache for the fast paths: batched with a mask, or one query at a time.

A verification forward must give each token the logits a one-token forward would, or
speculation is not lossless. SDPA's batched kernel rounds a query differently when other
queries share the call (in half precision, enough to flip greedy choices). FastLlamaRunner's
decoding and verification run the tree attention kernel instead (tree_attention.py), whose
result for a query depends only on the keys it sees; SDPA runs its prefills (a causal mask),
and, where that kernel is not in use (no C compiler, compile(), FastGPT2Runner), passes no
mask to mean "each query alone": query j then runs the very call a one-token forward makes
for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.runners.projection import row_independent_products


def attend(
    q: torch.Tensor,  # [heads, n, d], the new tokens' queries
    keys: torch.Tensor,  # [kv_heads, cached + n, d]
    values: torch.Tensor,  # [kv_heads, cached + n, d]
    mask: torch.Tensor | None,  # [n, cached + n] bool; None: each query alone
    scale: float | None = None,  # None: 1 / sqrt(d)
) -> torch.Tensor:  # [heads, n, d]
    n = q.shape[1]
    if mask is not None or n == 1:
        return _sdpa(q, keys, values, mask, scale)
    # query j alone over the keys it may see: the very call a one-token forward makes
    seen = keys.shape[1] - n + 1
    return torch.cat(
        [_sdpa(q[:, j : j + 1], keys[:, : seen + j], values[:, : seen + j], None, scale) for j in range(n)], dim=1
    )


def per_query_by_default(dtype: torch.dtype, device: torch.device) -> bool:
    """On the CPU, where oneDNN runs the products and keeps their rows apart (projection.py):
    there one query at a time makes verification exact, bit for bit (tested)."""
    return device.type == "cpu" and row_independent_products(dtype)


def _sdpa(
    q: torch.Tensor,  # [heads, n, d]
    keys: torch.Tensor,  # [kv_heads, length, d]
    values: torch.Tensor,  # [kv_heads, length, d]
    mask: torch.Tensor | None,  # [n, length] bool
    scale: float | None,
) -> torch.Tensor:  # [heads, n, d]
    """One attention call, with the query heads that share a key/value head (grouped-query
    attention) stacked as rows of that head's queries: [kv_heads, group * n, d]. The CPU's
    flash kernel pays a fixed cost per head, and enable_gqa pays it for every query head, so
    grouping costs a fraction (benchmarks/results/earlier-measurements.md)."""
    heads, n, d = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # query head h reads key/value head h // group (as transformers' repeat_kv): rows (h % group, query)
    grouped = q.reshape(kv_heads, group * n, d)
    if mask is not None and group > 1:
        mask = mask.repeat(group, 1)  # [group * n, length]
    out = F.scaled_dot_product_attention(grouped[None], keys[None], values[None], attn_mask=mask, scale=scale)[0]
    return out.view(heads, n, d)
