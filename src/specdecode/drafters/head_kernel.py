"""The draft head's decoder layer in one C call (kernels/int8_layer.py), for drafting.

A head forward of a few rows on torch is about 35 operations of microseconds each, most of its
time; the C decoder layer runs the same layer (rms norms, rope, the tree attention kernel, the
gated MLP, the residual sums) in one call on the w8a8 product kernel, a third less for a whole
head forward (benchmarks/results/draft-head-products-c-layer.md). Its products quantize each
row's activations to 8 bits where the trained layer's are float32, so a draft may now and then
differ from the trained layer's: deterministic all the same, which is all a drafter needs (its
drafts are verified).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from specdecode.kernels import int8_layer
from specdecode.runners.projection import int8_projection


class LayerCache(Protocol):
    """What the C layer reads and writes of a cache: per layer (one here) keys and values
    [kv heads, capacity, head_dim] float32, and the rows held."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int

    @property
    def capacity(self) -> int: ...

    def reserve(self, rows: int) -> None: ...


class KernelLayer:
    """A head layer bound to the C decoder layers: `(x, positions, cache, mask) -> g`, appending
    the rows' keys and values to cache as HeadLayer's caller does."""

    def __init__(self, bound: int8_layer.BoundLayers, rotation: Callable[[torch.Tensor], tuple]):
        self._bound = bound
        self._rotation = rotation  # positions [n] -> cos, sin [n, head_dim]: the head layer's table

    def __call__(
        self,
        x: torch.Tensor,  # [n, hidden] float32, the layer's input (overwritten)
        positions: torch.Tensor,  # [n] int64
        cache: LayerCache,
        mask: torch.Tensor | None,  # [n, cache.length + n] bool, True: attends; None: causal
    ) -> torch.Tensor:  # [n, hidden], the layer's output
        n = x.shape[0]
        cache.reserve(n)
        plan = attention_plan(mask, cache.length, n)
        cos, sin = self._rotation(positions)
        x = x.contiguous()
        self._bound(x, [cos.contiguous()], [sin.contiguous()], [cache], [n], [plan])
        cache.length += n
        return x


def attention_plan(mask: torch.Tensor | None, length: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A mask [n, length + n] (None: causal) as the tree attention kernel's plan: row i sees cache
    positions 0 .. contiguous[i] - 1, then the positions in extra[i] until a -1 (int32 both)."""
    if mask is None:
        return torch.arange(length + 1, length + n + 1, dtype=torch.int32), torch.empty(n, 0, dtype=torch.int32)
    blocked = ~mask
    contiguous = torch.where(blocked.any(1), blocked.int().argmax(1), mask.shape[1])  # the first unseen position
    rest = [row[lead:].nonzero().flatten() + lead for row, lead in zip(mask, contiguous.tolist())]
    extra = torch.full((n, max(len(r) for r in rest)), -1, dtype=torch.int32)
    for i, positions in enumerate(rest):
        extra[i, : len(positions)] = positions
    return contiguous.to(torch.int32), extra


def kernel_layer(layer: nn.Module, rotation: Callable[[torch.Tensor], tuple]) -> KernelLayer | None:
    """layer (a trained HeadLayer: attn_norm, q, k, v, o, mlp_norm, gate, up, down) on the C
    decoder layers; None where they or the own w8a8 product kernel do not run."""
    layers = int8_layer.load()
    if layers is None:
        return None
    with torch.no_grad():

        def product(*linears: nn.Linear):
            return int8_projection(torch.cat([linear.weight for linear in linears]), None)

        products = {
            "qkv": product(layer.q, layer.k, layer.v),
            "o": product(layer.o),
            "gate_up": product(layer.gate, layer.up),
            "down": product(layer.down),
        }
        if any(p.compensation is None for p in products.values()):  # not in the own kernel's layout
            return None
        weights = int8_layer.Layer(layer.attn_norm.detach().float(), layer.mlp_norm.detach().float(), **products)
    c = layer.config
    bound = layers.bind([weights], torch.float32, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
    return KernelLayer(bound, rotation)
