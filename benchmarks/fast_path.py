"""The fast path against transformers, in one run: issue 17's five figures for the default model.

1. target-only tokens/s of this engine and of transformers' `generate`, in float32 and in
   bfloat16 (same model object, same held-out Spec-Bench prompts, interleaved per prompt);
2. a verification forward over 5 tokens against a one-token forward (bfloat16 and float32,
   after 200 cached tokens);
3. prompt lookup on copy-type prompts in bfloat16: tokens/s, and whether every output equals
   bfloat16 target-only decoding;
4. the memory a loaded model adds: RSS after `SpeculativeEngine.from_pretrained` and one short
   generation, minus RSS before, against the weights' bytes (each dtype in a fresh process);
5. with --compile, 1-3 again for bfloat16 compiled by torch.compile (compiled before timing).

    .venv/bin/python benchmarks/fast_path.py [--new-tokens 64] [--compile] [--out benchmarks/results/fast-path.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.environment import cpu_name
from specdecode.bench.profiler import cached_forward_ms, rss_bytes
from specdecode.bench.prompts import load_prompts

NO_CACHE = CacheOptions(response_cache=False, draft_store=False)  # time decoding, not caches
HELD_OUT = ("writing", "qa", "coding", "stem")  # the third prompt of each: the bench's defaults take the first
COPY_PROMPTS = [
    "Copy this sentence exactly: Speculative decoding lets a small drafter propose tokens that a large model "
    "verifies in one pass, so generation gets faster without changing its output.",
    "Repeat the following list word for word: apples, bananas, cherries, dates, elderberries, figs, grapes, "
    "honeydew melons, kiwis, lemons, mangoes and nectarines.",
    "Rename the variable `total` to `sum_of_values` in this code and print the whole function:\n"
    "def add_all(values):\n    total = 0\n    for value in values:\n        total += value\n    return total\n",
]


def held_out_prompts() -> list[str]:
    prompts = load_prompts()
    return [[p for p in prompts if p.category == c][2].text for c in HELD_OUT]


def speed(dtype: str, new_tokens: int, compile: bool = False) -> dict:
    """transformers' generate and this engine's target-only decoding, interleaved per prompt."""
    engine = SpeculativeEngine.from_pretrained(
        drafter="prompt-lookup", device="cpu", dtype=dtype, cache=NO_CACHE, keep_model_weights=True, compile=compile
    )
    model = engine.target_runner.model
    start = time.perf_counter()
    if compile:  # every size speculation runs (1 to k + 1 tokens) compiles before anything is timed
        for n in range(1, engine.num_speculative_tokens + 2):
            cached_forward_ms(engine.target_runner, n, repeats=1)
    compile_seconds = time.perf_counter() - start
    prompts = [engine.encode(p, chat=True) for p in held_out_prompts()]
    hf, ours = [], []
    eos, engine.eos_token_ids = engine.eos_token_ids, frozenset()  # both decode exactly new_tokens
    for ids in [prompts[0], *prompts]:  # the first pass warms up and is not kept
        input_ids = torch.tensor([ids])
        start = time.perf_counter()
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
        hf.append(new_tokens / (time.perf_counter() - start))
        result = engine.generate([ids], max_new_tokens=new_tokens, speculative=False)[0]
        ours.append(result.stats.tokens_per_second)
    engine.eos_token_ids = eos
    copy_ids = [engine.encode(p, chat=True) for p in COPY_PROMPTS]
    engine.generate([copy_ids[0]], max_new_tokens=8)  # warm the verification shapes
    lookup, identical = [], 0
    for ids in copy_ids:
        base = engine.generate([ids], max_new_tokens=new_tokens, speculative=False)[0]
        spec = engine.generate([ids], max_new_tokens=new_tokens)[0]
        lookup.append(spec.stats.tokens_per_second)
        identical += spec.token_ids == base.token_ids
    return dict(
        dtype=dtype + (", compiled" if compile else ""),
        compile_seconds=compile_seconds,
        largest_size=engine.num_speculative_tokens + 1,
        hf=statistics.median(hf[1:]),
        ours=statistics.median(ours[1:]),
        forward_1=cached_forward_ms(engine.target_runner, 1),
        forward_5=cached_forward_ms(engine.target_runner, 5),
        lookup=statistics.median(lookup),
        identical=f"{identical}/{len(copy_ids)}",
    )


def memory(dtype: str) -> dict:
    """Run in a fresh process (`--memory DTYPE`): RSS added by loading and one short generation."""
    from transformers.models.llama import modeling_llama  # noqa: F401 - imported before the first reading

    before = rss_bytes()
    engine = SpeculativeEngine.from_pretrained(drafter="prompt-lookup", device="cpu", dtype=dtype, cache=NO_CACHE)
    engine.generate(["Say hello."], max_new_tokens=8)
    added = rss_bytes() - before
    model = engine.target_runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    # what the tokenizer alone takes: a second copy of it, loaded after the reading above
    with_engine = rss_bytes()
    AutoTokenizer.from_pretrained(engine.tokenizer.name_or_path)
    tokenizer = rss_bytes() - with_engine
    return dict(
        dtype=dtype, weights=weights, added=added, kv_cache=engine.target_runner.cache.nbytes, tokenizer=tokenizer
    )


def report(speeds: list[dict], memories: list[dict], new_tokens: int) -> str:
    lines = [
        f"Default model (SmolLM2-135M-Instruct), {os.cpu_count()} CPUs of {cpu_name()}, "
        f"{torch.get_num_threads()} threads, greedy, {new_tokens} new tokens; median over prompts.",
        "",
        "| dtype | transformers generate tok/s | target-only tok/s | ratio | forward 1 token ms "
        "| forward 5 tokens ms | 5 / 1 | prompt lookup on copy prompts tok/s | identical to target-only |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in speeds:
        lines.append(
            f"| {s['dtype']} | {s['hf']:.1f} | {s['ours']:.1f} | {s['ours'] / s['hf']:.2f}x | {s['forward_1']:.1f} "
            f"| {s['forward_5']:.1f} | {s['forward_5'] / s['forward_1']:.2f} | {s['lookup']:.1f} | {s['identical']} |"
        )
    for s in speeds:
        if s["compile_seconds"] > 1:
            sizes = f"1 to {s['largest_size']}"
            lines.append(f"\n{s['dtype']}: compiling sizes {sizes} took {s['compile_seconds']:.0f} s before timing.")
    lines += [
        "",
        "| dtype | weights MB | RSS added MB | of which KV cache MB | of which tokenizer MB | RSS added / weights "
        "| without the KV cache | without the KV cache and tokenizer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in memories:
        mb = {k: m[k] / 1e6 for k in ("weights", "added", "kv_cache", "tokenizer")}
        model_only = m["added"] - m["kv_cache"] - m["tokenizer"]
        lines.append(
            f"| {m['dtype']} | {mb['weights']:.0f} | {mb['added']:.0f} | {mb['kv_cache']:.0f} | {mb['tokenizer']:.0f} "
            f"| {m['added'] / m['weights']:.2f}x | {(m['added'] - m['kv_cache']) / m['weights']:.2f}x "
            f"| {model_only / m['weights']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/fast-path.md")
    parser.add_argument("--compile", action="store_true", help="also bfloat16 compiled by torch.compile")
    parser.add_argument("--memory", help=argparse.SUPPRESS)  # internal: one memory reading, as JSON
    args = parser.parse_args()
    if args.memory:
        print(json.dumps(memory(args.memory)))
        return
    dtypes = ("float32", "bfloat16")
    memories = [
        json.loads(
            subprocess.run(
                [sys.executable, __file__, "--memory", d], capture_output=True, text=True, check=True
            ).stdout.splitlines()[-1]
        )
        for d in dtypes
    ]
    speeds = [speed(d, args.new_tokens) for d in dtypes]
    if args.compile:
        speeds.append(speed("bfloat16", args.new_tokens, compile=True))
    text = report(speeds, memories, args.new_tokens)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
