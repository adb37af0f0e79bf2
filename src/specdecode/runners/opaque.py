"""Two operations that `torch.compile` calls as they are, without looking into them.

Eager code calls the kernels directly; under compilation (FastLlamaRunner.compile) each runs
as a custom operator, opaque to inductor:
- a oneDNN product with a reordered weight: inductor cannot lower a weight in oneDNN's
  blocked layout, and would otherwise fail to compile the forward;
- a write of new rows into a layer's KV cache, in place: functionalized, the write became a
  copy of the layer's whole cache (and a copy back), which made the compiled forward slower
  than the eager one (benchmarks/results/earlier-measurements.md).
"""

from __future__ import annotations

import torch


def onednn_linear(
    x: torch.Tensor,  # [n, in]
    weight: torch.Tensor,  # [out, in] in oneDNN's layout (torch.ops.mkldnn._reorder_linear_weight)
    bias: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [n, out]
    return (_onednn_linear_op if torch.compiler.is_compiling() else _linear)(x, weight, bias)


def write_rows(
    cache: torch.Tensor,  # [kv_heads, capacity, head_dim], one layer's keys or values
    start: int,
    rows: torch.Tensor,  # [kv_heads, n, head_dim], for positions start .. start + n - 1
) -> None:
    (_write_rows_op if torch.compiler.is_compiling() else _write)(cache, start, rows)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _write(cache: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    cache[:, start : start + rows.shape[1]] = rows


@torch.library.custom_op("specdecode::onednn_linear", mutates_args=())
def _onednn_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _linear(x, weight, bias)


@_onednn_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])  # the reordered weight keeps its [out, in] shape


@torch.library.custom_op("specdecode::write_rows", mutates_args=("cache",))
def _write_rows_op(cache: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    _write(cache, start, rows)


@_write_rows_op.register_fake
def _(cache: torch.Tensor, start: int, rows: torch.Tensor) -> None:
    return None
