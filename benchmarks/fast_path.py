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

    .venv/bin/python benchmarks/fast_path.py [--max-new-tokens 64] [--compile] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from transformers import AutoTokenizer

from specdecode import SpeculativeEngine
from specdecode.bench.interleave import interleave, medians
from specdecode.bench.prompts import COPY_PROMPTS, held_out_prompts
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.runners.profiling import cached_forward_ms, rss_bytes


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
    eos, engine.eos_token_ids = engine.eos_token_ids, frozenset()  # both decode exactly new_tokens

    def hf(ids: list[int]) -> None:
        input_ids = torch.tensor([ids])
        mask = torch.ones_like(input_ids)
        model.generate(
            input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )

    def ours(ids: list[int]) -> None:
        engine.generate([ids], max_new_tokens=new_tokens, speculative=False)

    # side by side per prompt, after one untimed pass of each on the first prompt
    seconds = medians(interleave({"hf": hf, "ours": ours}, prompts, warm_up=1))
    engine.eos_token_ids = eos
    copy_ids = [engine.encode(p, chat=True) for p in COPY_PROMPTS]

    def decode(speculative: bool):
        return lambda ids: engine.generate([ids], max_new_tokens=new_tokens, speculative=speculative)[0]

    lookup = interleave({"target-only": decode(False), "lookup": decode(True)}, copy_ids, warm_up=1)
    outputs = {(r.system, r.item): r.value.token_ids for r in lookup}
    identical = sum(outputs["lookup", i] == outputs["target-only", i] for i in range(len(copy_ids)))
    lookup_speed = statistics.median(r.value.stats.tokens_per_second for r in lookup if r.system == "lookup")
    return dict(
        dtype=dtype + (", compiled" if compile else ""),
        compile_seconds=compile_seconds,
        largest_size=engine.num_speculative_tokens + 1,
        hf=new_tokens / seconds["hf"],
        ours=new_tokens / seconds["ours"],
        forward_1=cached_forward_ms(engine.target_runner, 1),
        forward_5=cached_forward_ms(engine.target_runner, 5),
        lookup=lookup_speed,
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
    header = ["dtype", "transformers generate tok/s", "target-only tok/s", "ratio", "forward 1 token ms"]
    header += ["forward 5 tokens ms", "5 / 1", "prompt lookup on copy prompts tok/s", "identical to target-only"]
    rows = [
        [s["dtype"], f"{s['hf']:.1f}", f"{s['ours']:.1f}", f"{s['ours'] / s['hf']:.2f}x", f"{s['forward_1']:.1f}"]
        + [f"{s['forward_5']:.1f}", f"{s['forward_5'] / s['forward_1']:.2f}", f"{s['lookup']:.1f}", s["identical"]]
        for s in speeds
    ]
    lines = [
        f"Default model (SmolLM2-135M-Instruct), greedy, {new_tokens} new tokens; median over prompts.",
        "",
        markdown_table(header, rows),
    ]
    for s in speeds:
        if s["compile_seconds"] > 1:
            sizes = f"1 to {s['largest_size']}"
            lines.append(f"\n{s['dtype']}: compiling sizes {sizes} took {s['compile_seconds']:.0f} s before timing.")
    header = ["dtype", "weights MB", "RSS added MB", "of which KV cache MB", "of which tokenizer MB"]
    header += ["RSS added / weights", "without the KV cache", "without the KV cache and tokenizer"]
    rows = []
    for m in memories:
        mb = {k: f"{m[k] / 1e6:.0f}" for k in ("weights", "added", "kv_cache", "tokenizer")}
        model_only = m["added"] - m["kv_cache"] - m["tokenizer"]
        rows.append(
            [
                m["dtype"],
                mb["weights"],
                mb["added"],
                mb["kv_cache"],
                mb["tokenizer"],
                f"{m['added'] / m['weights']:.2f}x",
            ]
            + [f"{(m['added'] - m['kv_cache']) / m['weights']:.2f}x", f"{model_only / m['weights']:.2f}x"]
        )
    return "\n".join([*lines, "", markdown_table(header, rows)])


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=64)
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
    speeds = [speed(d, args.max_new_tokens) for d in dtypes]
    if args.compile:
        speeds.append(speed("bfloat16", args.max_new_tokens, compile=True))
    write_table(report(speeds, memories, args.max_new_tokens), args.out)


if __name__ == "__main__":
    main()
