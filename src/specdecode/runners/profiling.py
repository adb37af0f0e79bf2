"""A measured cost model of a runner (`specdecode profile`): what a cached forward costs, beside
what the hardware allows.

Two floors bound a forward over n new tokens from below:
- bandwidth: every weight is read once, whatever n is: weight bytes / read bandwidth;
- compute: 2 * parameters * n multiply-adds (plus attention) / matrix-product rate.
A forward near the larger floor cannot get much faster; one far above both is overhead.
Speculative decoding pays when forward(k + 1) costs little more than forward(1).

The timing primitives here (`timed`, `median_seconds`) are the ones the benchmarks use too
(specdecode.bench.interleave).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from specdecode.runners.base import ModelRunner

T = TypeVar("T")
PROFILED_SIZES = (1, 2, 4, 5, 8, 16, 32)  # new tokens of the timed forwards


@dataclass(frozen=True)
class Hardware:
    read_bandwidth: float  # bytes/s, reading a tensor far larger than the caches
    matmul_flops: float  # FLOP/s of a large square matrix product in the model's dtype


@dataclass(frozen=True)
class ForwardCost:
    new_tokens: int
    seconds: float  # median of the repeats
    bandwidth_floor: float
    compute_floor: float
    spread: float = 0.0  # half the interquartile range of the repeats, over their median
    ratio: float = 1.0  # median over rounds of this size's time over the smallest size's in the same round
    ratio_spread: float = 0.0  # half the interquartile range of those ratios


def _half_iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    low, _, high = statistics.quantiles(values, n=4)
    return (high - low) / 2


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """fn()'s result and its wall time; on a GPU, queued kernels are waited for on both sides."""
    _synchronize()
    start = time.perf_counter()
    result = fn()
    _synchronize()
    return result, time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of repeats calls of fn, after warmup untimed ones (first-call allocations)."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn)[1] for _ in range(repeats))


def measure_hardware(dtype: torch.dtype = torch.float32, device: str = "cpu") -> Hardware:
    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32, device=device)  # 256 MB: far beyond any cache
    read = median_seconds(big.sum, repeats=5)
    a = torch.randn(1024, 1024, dtype=dtype, device=device)
    product = median_seconds(lambda: a @ a, repeats=5)
    return Hardware(read_bandwidth=big.numel() * 4 / read, matmul_flops=2 * 1024**3 / product)


def cached_forward_ms(runner: ModelRunner, new_tokens: int, prefix: int = 200, repeats: int = 15) -> float:
    """Median milliseconds of a forward over new_tokens (logits for all) after `prefix` cached tokens."""
    tokens = torch.arange(1000, 1000 + prefix + new_tokens) % runner.vocab_size
    runner.reset()
    runner.forward(tokens[:prefix], 1)

    def forward() -> None:
        runner.crop(prefix)
        runner.forward(tokens[prefix:], new_tokens)

    return median_seconds(forward, repeats) * 1e3


def rss_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def weight_bytes(model: PreTrainedModel) -> int:
    """Bytes a forward reads: every parameter once, the tied embedding counted once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def forward_flops(model: PreTrainedModel, new_tokens: int, context: int) -> float:
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings().weight.numel()
    matmul_params = sum(p.numel() for p in model.parameters() if p.dim() == 2) - embedding
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    head = embedding if tied else 0  # the output head is a matrix product too (one logit row here)
    attention = 4 * new_tokens * context * config.hidden_size * config.num_hidden_layers
    return 2 * matmul_params * new_tokens + 2 * head + attention


def profile_forward(
    runner: ModelRunner,
    model: PreTrainedModel,
    hardware: Hardware,
    new_tokens: tuple[int, ...] = PROFILED_SIZES,
    prefix: int = 200,
    repeats: int = 7,
) -> list[ForwardCost]:
    """Median time of a cached forward over n new tokens after a prefix, beside the floors.

    Each forward returns logits for all n positions, as verifying n - 1 drafts needs. The sizes
    are timed in rounds, each size once a round (after two untimed rounds): a neighbour's burst
    on a shared machine then lands on every size alike, not on the one timed while it lasted.
    A size's cost relative to the smallest is taken within each round (a pair timed moments
    apart) and the median of those ratios given, with the spread of both.
    """
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (prefix + max(new_tokens),), generator=generator)
    runner.reset()
    runner.forward(tokens[:prefix], 1)  # prefill once; each timed forward rolls back to here

    def forward(n: int) -> torch.Tensor:
        runner.crop(prefix)
        return runner.forward(tokens[prefix : prefix + n], n)

    seconds: dict[int, list[float]] = {n: [] for n in new_tokens}
    for round_ in range(2 + repeats):
        for n in new_tokens:
            elapsed = timed(lambda: forward(n))[1]  # noqa: B023 - called now, in this iteration
            if round_ >= 2:  # the first rounds allocate
                seconds[n].append(elapsed)
    costs = []
    for n in new_tokens:
        median = statistics.median(seconds[n])
        ratios = [t / first for t, first in zip(seconds[n], seconds[new_tokens[0]], strict=True)]
        costs.append(
            ForwardCost(
                n,
                median,
                bandwidth_floor=weight_bytes(model) / hardware.read_bandwidth,
                compute_floor=forward_flops(model, n, prefix + n) / hardware.matmul_flops,
                spread=_half_iqr(seconds[n]) / median,
                ratio=statistics.median(ratios),
                ratio_spread=_half_iqr(ratios),
            )
        )
    return costs


def render_table(title: str, costs: list[ForwardCost]):
    """A rich table: each measured time (and its spread) beside its two floors, and the cost
    relative to the first size's, taken round by round (and its spread)."""
    from rich.table import Table

    table = Table(title=title)
    columns = ("new tokens", "forward ms", "± %", f"x {costs[0].new_tokens}-token", "±")
    for column in (*columns, "bandwidth floor ms", "compute floor ms", "x max floor"):
        table.add_column(column, justify="right")
    for c in costs:
        floor = max(c.bandwidth_floor, c.compute_floor)
        table.add_row(
            str(c.new_tokens),
            f"{c.seconds * 1e3:.2f}",
            f"{c.spread * 100:.0f}",
            f"{c.ratio:.2f}",
            f"{c.ratio_spread:.2f}",
            f"{c.bandwidth_floor * 1e3:.1f}",
            f"{c.compute_floor * 1e3:.1f}",
            f"{c.seconds / floor:.1f}",
        )
    return table


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
