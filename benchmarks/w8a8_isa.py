"""The w8a8 fast path on each build of the int8 kernels this CPU runs (cpu.KERNEL_ISAS:
AMX, AVX512-VNNI, AVX2, portable C), one process, the builds interleaved.

For each build, forced as SPECDECODE_KERNEL_ISA forces it (its products, its w8a16 head and its C
decoder layers), the default model in bfloat16 with the default w8a8 recipe:
- perplexity on the first --tokens tokens of docs/design.md, and whether that prefill's logits
  have the first build's bits (they must: every build computes the same integer sums and the
  same float operations in the same order);
- the median time of a forward over 1, 8 and 16 new tokens after --prefix cached tokens, and of
  the prefix's prefill, the builds alternated every repeat;
- the products alone (30 layers' and the w8a16 head's, weights warm in cache), 1, 8 and 16 rows.

    .venv/bin/python benchmarks/w8a8_isa.py [--isas amx avx512-vnni avx2] [--tokens 2048] [--repeats 15]
        [--prefix 200] [--out FILE]
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdecode import cpu
from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.kernels import int8_kernel
from specdecode.loading import DEFAULT_TARGET, load_model
from specdecode.runners.fast_llama import FastLlamaRunner

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "docs" / "design.md"
SIZES = (1, 8, 16)


@contextlib.contextmanager
def build(isa: str):
    """The process's int8 kernels from this build meanwhile (the variable, and load()'s choice)."""
    previous, kept = os.environ.get(cpu.KERNEL_ISA_VARIABLE), list(int8_kernel._ready)
    os.environ[cpu.KERNEL_ISA_VARIABLE] = isa
    int8_kernel._ready.clear()
    try:
        assert int8_kernel.load().isa == isa
        yield
    finally:
        os.environ.pop(cpu.KERNEL_ISA_VARIABLE, None)
        if previous is not None:
            os.environ[cpu.KERNEL_ISA_VARIABLE] = previous
        int8_kernel._ready[:] = kept


def prefill_logits(runner: FastLlamaRunner, ids: list[int]) -> torch.Tensor:  # benchmarks/int8.py's way
    runner.reset()
    return runner.forward(torch.tensor(ids), len(ids) - 1)[:-1]


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    return float(torch.exp(F.cross_entropy(logits.double(), torch.tensor(ids[2:]))))


def forward_ms(runners: dict[str, FastLlamaRunner], prefix: list[int], repeats: int) -> dict:
    """Median ms per build of a forward over n new tokens after the prefix, and of the prefix's
    prefill ("prefill"), the builds alternated (the first pass warms up, untimed)."""
    times: dict = {(isa, n): [] for isa in runners for n in (*SIZES, "prefill")}
    new = torch.arange(100, 100 + max(SIZES))
    for repeat in range(repeats + 1):
        for isa in list(runners) if repeat % 2 else list(runners)[::-1]:
            runner = runners[isa]
            with build(isa):
                runner.reset()
                start = time.perf_counter()
                runner.forward(torch.tensor(prefix), 1)
                lap = {"prefill": time.perf_counter() - start}
                for n in SIZES:
                    runner.crop(len(prefix))
                    start = time.perf_counter()
                    runner.forward(new[:n], n)
                    lap[n] = time.perf_counter() - start
            if repeat:
                for key, seconds in lap.items():
                    times[isa, key].append(seconds * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def products_ms(runners: dict[str, FastLlamaRunner], repeats: int) -> dict:
    """Median ms per build of the layers' products (as the C layers call them) and the head,
    n rows of random activations, weights warm in cache."""
    times: dict = {(isa, n): [] for isa in runners for n in SIZES}
    for n in SIZES:
        for repeat in range(repeats + 1):
            for isa, runner in runners.items():
                products = [getattr(layer, name) for layer in runner.layers for name in ("qkv", "o", "gate_up", "down")]
                inputs = [torch.randn(n, p.shape[1]).bfloat16() for p in products]
                x = torch.randn(n, runner.lm_head.shape[1]).bfloat16()
                with build(isa):
                    start = time.perf_counter()
                    for p, rows in zip(products, inputs):
                        p(rows)
                    runner.lm_head(x)
                    if repeat:
                        times[isa, n].append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--isas", nargs="*", default=list(cpu.runnable_kernel_isas()[:2]), help="the builds")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prefix", type=int, default=200)
    args = parser.parse_args()
    model, tokenizer = load_model(DEFAULT_TARGET, "cpu", "bfloat16")
    ids = tokenizer(TEXT.read_text()).input_ids[: args.tokens]
    runners, logits = {}, {}
    for isa in args.isas:
        with build(isa):
            runners[isa] = FastLlamaRunner(model, "w8a8")
            assert runners[isa]._int8_layers is not None and runners[isa]._int8_layers._kernel.isa == isa
            logits[isa] = prefill_logits(runners[isa], ids)
        print(f"{isa}: perplexity {perplexity(logits[isa], ids):.3f}", flush=True)
    ms = forward_ms(runners, ids[: args.prefix], args.repeats)
    products = products_ms(runners, args.repeats)
    first = args.isas[0]
    rows = []
    for isa in args.isas:
        same = torch.equal(logits[isa].view(torch.int16), logits[first].view(torch.int16))
        row = [isa, f"{perplexity(logits[isa], ids):.3f}", "yes" if same else "NO"]
        row += [f"{ms[isa, n]:.2f} ({ms[isa, n] / ms[first, n]:.2f}x)" for n in (*SIZES, "prefill")]
        row += [f"{products[isa, n]:.2f} ({products[isa, n] / products[first, n]:.2f}x)" for n in SIZES]
        rows.append(row)
    header = ["build", f"perplexity, design.md ({len(ids)} tokens)", f"prefill logits bits = {first}'s"]
    header += [f"forward {n} ms" for n in SIZES] + [f"prefill {args.prefix} ms"]
    header += [f"products {n} rows ms" for n in SIZES]
    note = f"default recipe (head w8a16), bfloat16; medians of {args.repeats}, {torch.get_num_threads()} threads"
    write_table(markdown_table(header, rows) + f"\n\n{note}", args.out)


if __name__ == "__main__":
    main()
