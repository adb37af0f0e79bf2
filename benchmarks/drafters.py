"""Every drafter against target-only decoding of the default model, in one run.

Greedy, 64 new tokens, chat template on. For each prompt, target-only decoding runs
before and after the drafters (their mean is that prompt's baseline), and each drafter's
output is checked token for token against it. Per drafter and prompt type (copy-type:
copy, edit, extract, summarize; open-ended): acceptance rate, mean accepted length
(tokens per target forward), mean k, tokens/s, and speedup = baseline seconds / drafter
seconds over the same prompts. Adaptive drafters share the target's step costs and keep
what they measured from prompt to prompt, as in a server.

    .venv/bin/python benchmarks/drafters.py [--new-tokens 64] [--out benchmarks/results/drafters.md]
"""

from __future__ import annotations

import argparse
import copy
import platform
import time
from collections import defaultdict

import torch
from transformers import LlamaForCausalLM

from report import emit
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.drafters import (
    AutoDrafter,
    CrossTokenizerDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    self_quantized_drafter,
)
from specdecode.loading import load_model
from specdecode.runners import runner_for

PASSAGE = (
    "The city council met on Tuesday to discuss the new public library. The building will have three floors, "
    "a children's reading room, and a cafe. Construction starts in March and should take eighteen months. "
    "The budget is twelve million dollars, paid for by a state grant and local taxes."
)
PROMPTS = {
    "copy": [
        f"Copy this text exactly, word for word: {PASSAGE}",
        f"Rewrite this text, replacing 'library' with 'museum' and changing nothing else: {PASSAGE}",
        f"Extract every sentence that contains a number from this text, one per line: {PASSAGE}",
        f"Summarize this text in two sentences, reusing its own words: {PASSAGE}",
    ],
    "open-ended": [
        "Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give five tips for staying focused while studying.",
        "Write a friendly email inviting a colleague to lunch.",
    ],
}


NO_CACHE = CacheOptions(response_cache=False, draft_store=False)  # time decoding, not caches


def random_draft(target) -> LlamaForCausalLM:
    """A useless draft: the target's architecture and vocabulary, 4 layers, random weights."""
    torch.manual_seed(0)
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = 4
    return LlamaForCausalLM(config).eval()


def drafters(engine: SpeculativeEngine, k_max: int, model_drafters: bool = True) -> dict[str, tuple]:
    """name -> (drafter, k, adaptive)."""
    target = engine.target_runner.model
    useless = ModelDrafter(runner_for(random_draft(target)))
    lookup_family = {
        "prompt-lookup, k=4": (PromptLookupDrafter(), 4, False),
        f"prompt-lookup, adaptive k<={k_max}": (PromptLookupDrafter(), k_max, True),
        f"auto (lookup), adaptive k<={k_max}": (AutoDrafter([PromptLookupDrafter()]), k_max, True),
        f"auto (lookup + random draft), adaptive k<={k_max}": (
            AutoDrafter([PromptLookupDrafter(), useless]),
            k_max,
            True,
        ),
    }
    if not model_drafters:
        return lookup_family
    gemma, gemma_tokenizer = load_model("gemma3-270m", "cpu", "float32")
    cross = CrossTokenizerDrafter(runner_for(gemma), gemma_tokenizer, engine.tokenizer)
    return lookup_family | {
        "self-quantized bf16, k=4": (self_quantized_drafter(target, "bfloat16"), 4, False),
        "self-quantized int8, k=4": (self_quantized_drafter(target, "int8"), 4, False),
        "cross-tokenizer gemma3-270m, k=4": (cross, 4, False),
        f"auto (lookup + cross-tokenizer gemma3), adaptive k<={k_max}": (
            AutoDrafter([PromptLookupDrafter(), copy.copy(cross)]),
            k_max,
            True,
        ),
    }


def timed(engine: SpeculativeEngine, prompt: str, new_tokens: int, speculative: bool = True):
    start = time.perf_counter()
    result = engine.generate(prompt, max_new_tokens=new_tokens, chat=True, speculative=speculative)[0]
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k-max", type=int, default=12)
    parser.add_argument("--out", default="benchmarks/results/drafters.md")
    parser.add_argument("--dtype", default="float32", help="the target's dtype (the drafters compare against it)")
    parser.add_argument("--lookup-only", action="store_true", help="only prompt lookup, auto and the random draft")
    args = parser.parse_args()

    engine = SpeculativeEngine.from_pretrained(
        "smollm2-135m-instruct",
        drafter="none",
        device="cpu",
        dtype=args.dtype,
        cache=NO_CACHE,
        keep_model_weights=True,  # the self-quantized drafters copy it
    )
    views = {}
    for name, (drafter, k, adaptive) in drafters(engine, args.k_max, not args.lookup_only).items():
        views[name] = view = engine.with_drafter(drafter, k, adaptive)  # shares the target and tokenizer
        timed(view, "Say hello.", 8)  # warm-up: first calls and first measurements
    totals = defaultdict(lambda: defaultdict(float))  # (drafter, kind) -> sums
    for kind, prompts in PROMPTS.items():
        for prompt in prompts:
            first, first_s = timed(engine, prompt, args.new_tokens, speculative=False)
            runs = {name: timed(view, prompt, args.new_tokens) for name, view in views.items()}
            last, last_s = timed(engine, prompt, args.new_tokens, speculative=False)
            assert first.token_ids == last.token_ids
            baseline_s = (first_s + last_s) / 2
            _add(totals["target-only", kind], first, baseline_s, baseline_s, True)
            for name, (result, seconds) in runs.items():
                _add(totals[name, kind], result, seconds, baseline_s, result.token_ids == first.token_ids)
            print(
                f"{kind:10s} {baseline_s:5.2f} s target-only | "
                + " | ".join(f"{name.split(',')[0]} {baseline_s / s:.2f}x" for name, (_, s) in runs.items()),
                flush=True,
            )
    emit(_table(totals, list(views), args), args.out)


def _add(sums: dict, result, seconds: float, baseline_s: float, identical: bool) -> None:
    stats = result.stats
    sums["drafted"] += stats.drafted_tokens
    sums["accepted"] += stats.accepted_tokens
    sums["forwards"] += stats.target_forwards
    sums["tokens"] += stats.generated_tokens
    sums["seconds"] += seconds
    sums["baseline_s"] += baseline_s
    sums["differ"] += not identical


def _table(totals: dict, names: list[str], args) -> str:
    lines = [
        f"# Drafters on smollm2-135m-instruct ({args.dtype}, CPU, {torch.get_num_threads()} threads, {platform.machine()})",
        "",
        f"Command: `.venv/bin/python benchmarks/drafters.py --new-tokens {args.new_tokens} --k-max {args.k_max} "
        f"--dtype {args.dtype}{' --lookup-only' if args.lookup_only else ''} --out {args.out}`. "
        f"Greedy, {args.new_tokens} new tokens, 4 prompts per type; speedup = target-only seconds / drafter "
        "seconds on the same prompts, target-only run before and after each prompt's drafters.",
        "",
        "| drafter | prompts | acceptance | mean accepted length | mean k | tokens/s | speedup | outputs identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ["target-only", *names]:
        for kind in PROMPTS:
            s = totals[name, kind]
            acceptance = f"{s['accepted'] / s['drafted']:.0%}" if s["drafted"] else "-"
            lines.append(
                f"| {name} | {kind} | {acceptance} | {s['tokens'] / s['forwards']:.2f} | "
                f"{s['drafted'] / s['forwards']:.1f} | {s['tokens'] / s['seconds']:.1f} | "
                f"{s['baseline_s'] / s['seconds']:.2f}x | {'yes' if not s['differ'] else 'NO'} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
