"""Bit-for-bit comparisons of the kernels' outputs, the inputs that try them, and the builds of
the int8 kernels to run them on."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

from specdecode import cpu

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


def c_layers_run_here() -> bool:
    """The own w8a8 products and the C decoder layers load on this machine (a CPU they run on,
    and gcc): what tests of the C layers, and of what only they allow, need."""
    from specdecode.kernels import int8_kernel, int8_layer
    from specdecode.runners import projection

    kernel = int8_kernel.load() if projection.int8_supported() else None
    return kernel is not None and projection.own_kernel() is not None and int8_layer.load() is not None


def kernel_isas() -> tuple[str, ...]:
    """The builds of the int8 kernels this CPU runs (AVX512-VNNI, AVX2, portable), fastest first:
    what the kernel tests run on, each compared with the same reference."""
    return cpu.runnable_kernel_isas()


@contextlib.contextmanager
def forced_kernel_isa(isa: str) -> Iterator[None]:
    """The process's int8 kernels (the products, w8a16 and the C decoder layers of runners built
    inside) from the `isa` build, as SPECDECODE_KERNEL_ISA forces it; the choice is made again
    after. Fails where that build is not the one that loads (a test would compare a build with
    itself)."""
    from specdecode.kernels import int8_kernel

    previous, kept = os.environ.get(cpu.KERNEL_ISA_VARIABLE), list(int8_kernel._ready)
    os.environ[cpu.KERNEL_ISA_VARIABLE] = isa
    int8_kernel._ready.clear()  # load() chooses again, from the variable
    try:
        kernel = int8_kernel.load()
        assert kernel is None or kernel.isa == isa, f"{isa} forced, {kernel.isa} loaded"
        yield
    finally:
        if previous is None:
            os.environ.pop(cpu.KERNEL_ISA_VARIABLE, None)
        else:
            os.environ[cpu.KERNEL_ISA_VARIABLE] = previous
        int8_kernel._ready[:] = kept


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def every_kind_of_forward(runner, layers: int) -> list[torch.Tensor]:
    """Logits and hidden states (layers 0, 1 and the output of `layers`) of every kind of forward:
    three prefills in one forward (one past a 64-query attention chunk), then a chain of 5, one
    token and a tree of 4 beside each other, then one-token decoding."""
    runner.hidden_layers = (0, 1, layers)

    def hidden() -> list[torch.Tensor]:  # a tensor, or one per sequence
        return list(runner.hidden) if isinstance(runner.hidden, list) else [runner.hidden]

    caches = [runner.new_cache() for _ in range(3)]
    prompts = [_tokens(n, seed=s) for n, s in ((70, 3), (12, 4), (27, 5))]
    results = runner.forward_batch(caches, prompts, [2, 2, 2]) + hidden()
    parents = [None, None, torch.tensor([-1, 0, 0, 1])]
    new = [_tokens(5, seed=6), _tokens(1, seed=7), _tokens(4, seed=8)]
    results += runner.forward_batch(caches, new, [5, 1, 4], parents) + hidden()
    runner.reset()
    return results + [runner.forward(_tokens(1, seed=9), 1)] + hidden()
