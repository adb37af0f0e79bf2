"""Verification forwards that give each new token the bits it gets alone, for transformers'
runner over a bitsandbytes model: attention one query at a time, LLM.int8 layers one row at
a time, and the layers left in float on the fast path's row-independent products.

A verification forward runs k + 1 new queries at once, and SDPA computes them in one
product whose rounding depends on how many queries share it. In float32 that moves the
last bits, rarely an argmax; but a bitsandbytes model rounds every quantized layer's input
to bfloat16, which turns those bits into whole bfloat16 steps, enough to flip greedy choices
(benchmarks/results/earlier-measurements.md). With this attention a token's hidden states are
those of decoding it alone, and speculative output equals the quantized model's own greedy
`generate` (tests/runners/test_quantized_targets.py, benchmarks/quantization.py).

So a forward with several new queries after a cache runs each query alone, against the keys
it would see alone (its own position and before), exactly as one-token decoding calls SDPA.
One-token forwards and prefills (no cache) are left to SDPA as they are; `generate()` on the
same model is therefore unchanged. The cost: k + 1 small attention calls per layer instead of
one, while the 4-bit weights, the dominant cost, are still read once per verification.

LLM.int8 layers (bitsandbytes int8 with an outlier threshold) compute in float the input
columns where any row of the product exceeds the threshold: a row's result depends on its
neighbours. During a verification forward (`verifying()`) they run one row at a time, as in
one-token decoding; that reads their int8 weights once per row. So do 4-bit layers on a CPU
without AVX512-BF16, where bitsandbytes multiplies a dequantized weight with torch's product.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specdecode.runners.projection import onednn_layout, projection

NAME = "specdecode_rowwise_sdpa"
_verifying = contextvars.ContextVar("specdecode_verifying", default=False)


@contextlib.contextmanager
def verifying() -> Iterator[None]:
    """Within: a forward of several new tokens after a cache (not a prefill)."""
    token = _verifying.set(True)
    try:
        yield
    finally:
        _verifying.reset(token)


def rowwise_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, queries, dim]
    key: torch.Tensor,  # [batch, kv heads, keys, dim]: the cache, then the new positions
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # [batch, 1, queries, keys] or None
    **kwargs,
) -> tuple[torch.Tensor, None]:  # [batch, queries, heads, dim]
    queries, keys = query.shape[2], key.shape[2]
    if queries == 1 or queries == keys:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    past = keys - queries
    rows = [
        sdpa_attention_forward(
            module,
            query[:, :, i : i + 1],
            key[:, :, : past + i + 1],
            value[:, :, : past + i + 1],
            _row_mask(attention_mask, i, past + i + 1),
            **kwargs,
        )[0]
        for i in range(queries)
    ]
    return torch.cat(rows, dim=1), None


def _row_mask(mask: torch.Tensor | None, row: int, keys: int) -> torch.Tensor | None:
    """Query row's mask over its keys; None where it allows them all, as one-token decoding
    passes none (a mask, even an all-allowing one, may take another SDPA kernel)."""
    if mask is None:
        return None
    row_mask = mask[:, :, row : row + 1, :keys]
    allows_all = bool(row_mask.all()) if row_mask.dtype == torch.bool else bool((row_mask == 0).all())
    return None if allows_all else row_mask


def make_rows_exact(model: PreTrainedModel) -> list[torch.nn.Linear]:
    """Switch a bitsandbytes model's attention (on SDPA) to rowwise_sdpa, its LLM.int8 layers
    to one row at a time within verifying(), and the linear layers it keeps in float (the head,
    4-bit's down projections: loading.FOUR_BIT_KEEPS) to the fast path's oneDNN products.
    Returns the layers whose weights those products now hold a copy of (the embedding's excepted)."""
    if model.config._attn_implementation == "sdpa":
        model.set_attn_implementation(NAME)
    embedding = model.get_input_embeddings().weight
    copied = []
    for module in model.modules():
        if _rounds_rows_together(module):
            module.forward = _one_row_at_a_time(module.forward)
        elif type(module) is torch.nn.Linear and onednn_layout(module.weight):
            _run_on_onednn(module)
            copied += [module] if module.weight is not embedding else []
    return copied


def _rounds_rows_together(module: torch.nn.Module) -> bool:
    """An LLM.int8 layer with an outlier threshold, or a 4-bit layer that bitsandbytes runs as a
    dequantized weight and torch's product (on CPUs without AVX512-BF16, for which it has no
    4-bit kernel of its own; that product rounds a row by the row count): a verification runs
    it one row at a time, as one-token decoding does."""
    if type(module).__name__ == "Linear8bitLt":
        return getattr(module.state, "threshold", 0) > 0
    four_bit = any(cls.__name__ == "Linear4bit" for cls in type(module).__mro__)
    return four_bit and not getattr(module, "support_avx512bf16_for_cpu", True)


def _run_on_onednn(linear: torch.nn.Linear) -> None:
    """F.linear rounds a row by the rows beside it (float32: MKL) or by the row count (one-row
    bfloat16 kernels on CPUs without AMX): verified rows then leave their one-token bits, and
    bfloat16 steps flip greedy choices (benchmarks/results/earlier-measurements.md). The fast
    path's products keep each row's bits
    (projection.Projection), and read their reordered weight faster."""
    product = projection(linear.weight, linear.bias, None)

    def forward(x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return product(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)

    linear.forward = forward


def _one_row_at_a_time(forward):
    def rowwise(x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, x.shape[-1])
        if not _verifying.get() or rows.shape[0] == 1:
            return forward(x)
        return torch.cat([forward(row[None]) for row in rows]).reshape(*x.shape[:-1], -1)

    return rowwise


AttentionInterface.register(NAME, rowwise_sdpa)
