"""The fast Llama runner compiled by torch.compile against itself eager, alternated in one process.

One engine (default model, bfloat16); its runner's compiled forward is switched off and on
between rounds, so that a noisy machine slows both alike. Per round and mode: a cached
forward over 1 and 5 tokens (after 200 cached tokens), and target-only decoding of the
held-out Spec-Bench prompts (64 tokens each). Compiling happens before any timing and is
reported apart (inductor keeps the code on disk: a second run compiles faster).

    .venv/bin/python benchmarks/compiled.py [--rounds 3] [--dtype bfloat16] [--out benchmarks/results/compiled.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from fast_path import NO_CACHE, held_out_prompts
from specdecode import SpeculativeEngine
from specdecode.bench.environment import cpu_name
from specdecode.bench.profiler import cached_forward_ms

MODES = ("eager", "compiled")


def measure(dtype: str, rounds: int, new_tokens: int = 64) -> tuple[float, dict]:
    engine = SpeculativeEngine.from_pretrained(
        drafter="prompt-lookup", device="cpu", dtype=dtype, cache=NO_CACHE, compile=True
    )
    runner = engine.target_runner
    compiled = runner._compiled_layers  # switched off and on below (a private switch, for this comparison only)
    start = time.perf_counter()
    for n in (1, 5):
        cached_forward_ms(runner, n, repeats=1)  # compiles this size
    compile_seconds = time.perf_counter() - start
    prompts = [engine.encode(p, chat=True) for p in held_out_prompts()]
    engine.eos_token_ids = frozenset()  # every run decodes exactly new_tokens
    found = {mode: {"forward_1": [], "forward_5": [], "tokens_per_second": [], "outputs": []} for mode in MODES}
    for _ in range(rounds):
        for mode in MODES:
            runner._compiled_layers = compiled if mode == "compiled" else None
            found[mode]["forward_1"].append(cached_forward_ms(runner, 1))
            found[mode]["forward_5"].append(cached_forward_ms(runner, 5))
            for ids in prompts:
                result = engine.generate([ids], max_new_tokens=new_tokens, speculative=False)[0]
                found[mode]["tokens_per_second"].append(result.stats.tokens_per_second)
                found[mode]["outputs"].append(result.token_ids)
    return compile_seconds, found


def report(dtype: str, rounds: int, compile_seconds: float, found: dict) -> str:
    identical = found["eager"]["outputs"] == found["compiled"]["outputs"]
    lines = [
        f"Default model (SmolLM2-135M-Instruct), {dtype}, {os.cpu_count()} CPUs of {cpu_name()}, "
        f"{torch.get_num_threads()} threads; {rounds} rounds alternating eager and compiled; medians.",
        f"Compiling sizes 1 and 5 took {compile_seconds:.0f} s before timing. "
        f"Target-only outputs identical eager and compiled: {identical}.",
        "",
        "| mode | forward 1 token ms | forward 5 tokens ms | 5 / 1 | target-only tok/s | each round's forward 1 ms |",
        "|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        f = found[mode]
        one, five = statistics.median(f["forward_1"]), statistics.median(f["forward_5"])
        rounds_1 = ", ".join(f"{x:.1f}" for x in f["forward_1"])
        lines.append(
            f"| {mode} | {one:.1f} | {five:.1f} | {five / one:.2f} "
            f"| {statistics.median(f['tokens_per_second']):.1f} | {rounds_1} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="benchmarks/results/compiled.md")
    args = parser.parse_args()
    text = report(args.dtype, args.rounds, *measure(args.dtype, args.rounds))
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
