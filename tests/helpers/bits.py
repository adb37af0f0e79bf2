"""Bit-for-bit comparisons of the kernels' outputs, and the inputs that try them."""

from __future__ import annotations

from collections.abc import Callable

import torch

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def awkward_rows(n: int, inputs: int, dtype: torch.dtype, seed: int, largest: float = 127.0) -> torch.Tensor:
    """[n, inputs]: rows of one scale each, from 1e-38 (float32's denormals) to 1e30, a row of
    zeros, a row of one value (every code the largest), and a row of scale 1 whose codes land
    on exact halves (`largest`: the largest code of the quantization under test)."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.randint(-38, 31, (n, 1), generator=generator).float()
    x = torch.randn(n, inputs, generator=generator) * magnitudes
    x[0] = 0.0
    if n > 2 and inputs >= 4:
        x[1] = -3.0
        x[2] = 0.0
        x[2, :4] = torch.tensor([largest, 0.5, 1.5, -2.5])
    return x.to(dtype)


def same_bits_on_one_thread_and_two(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = product(x)
        torch.set_num_threads(1)
        return same_bits(product(x), two)
    finally:
        torch.set_num_threads(threads)
