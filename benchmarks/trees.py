"""Draft trees on held-out chat prompts, in one run: target-only against each drafter.

The prompts below were written for this benchmark (none comes from Spec-Bench or any set a
drafter learns from): 12 open-ended ones, where the answer is new text, and 6 input-grounded
ones, where it copies or edits the prompt. Every system runs every prompt, interleaved per
prompt (the machine is shared and noisy), best of `--repeats` per prompt; every output is
checked against target-only decoding of the same engine (same precision). Systems:
- target-only;
- prompt-lookup: today's default drafter on open prompts (chains, adaptive k);
- recycling: the target's own predictions as a tree (drafters/recycling.py), adaptive size;
  its table is shared by the requests, so it starts empty and learns from the measured prompts
  that came before (never from the same prompt: each repeat starts from the table as it was);
- recycling, warm: the same after the table learnt from `--warm` other requests (a server
  that has run a while; the warm-up prompts are generated, not the measured ones).

    .venv/bin/python benchmarks/trees.py [--new-tokens 64] [--repeats 2] [--warm 40] [--k 16]
        [--out benchmarks/results/trees.md]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.environment import cpu_name

NO_CACHE = CacheOptions(response_cache=False, draft_store=False)

OPEN = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky looks blue during the day and red at sunset.",
    "Give me five tips for staying focused while working from home.",
    "What are the main differences between a violin and a viola?",
    "Describe a perfect autumn afternoon in a small mountain village.",
    "How does a refrigerator keep food cold? Explain it simply.",
    "Write a friendly email inviting my neighbours to a garden party on Saturday.",
    "What should a beginner know before adopting a cat?",
    "Suggest a three-day itinerary for a first visit to Lisbon.",
    "Why do people enjoy listening to sad music?",
    "Write a poem about the first snow of winter.",
    "Explain the rules of chess to a ten-year-old.",
]
GROUNDED = [
    "Fix the spelling mistakes in this sentence and return it: 'Teh quick brown fox jumpd over the lazzy dog "
    "while the farmer wachted from his tractor.'",
    "Convert this list to a numbered list, keeping every word: milk, eggs, flour, sugar, butter, baking soda, "
    "vanilla extract, salt, cinnamon.",
    "Rewrite this function with the variable `count` renamed to `total_items`:\n"
    "def tally(items):\n    count = 0\n    for item in items:\n        if item:\n            count += 1\n"
    "    return count\n",
    "Put this sentence in the past tense: 'She walks to the station, buys a ticket, and waits for the train "
    "that takes her to the city where she works.'",
    "Repeat this address exactly, on one line: 221B Baker Street, Marylebone, London NW1 6XE, United Kingdom.",
    'Translate this JSON into YAML: {"name": "Ada", "age": 36, "languages": ["English", "French"], "city": "London"}',
]
# warm-up requests for the shared table: generated topics, none of the measured prompts
WARM_TOPICS = ["rivers", "bicycles", "bread", "volcanoes", "libraries", "tea", "bridges", "owls", "jazz", "maps"]
WARM_ASKS = ["Tell me about {}.", "Write a paragraph about {}.", "What is interesting about {}?", "Explain {} simply."]


def warm_prompts(count: int) -> list[str]:
    return [a.format(t) for a in WARM_ASKS for t in WARM_TOPICS][:count]


def systems(base: SpeculativeEngine, k: int) -> dict[str, SpeculativeEngine]:
    from specdecode.drafters.factory import DrafterOptions, make_drafter

    def drafter(name: str):
        return make_drafter(name, None, base.target_runner, base.tokenizer, None, "auto", DrafterOptions())

    return {
        "target-only": base.with_drafter(None, 0),
        "prompt-lookup": base.with_drafter(drafter("prompt-lookup"), 4, adaptive=True),
        "recycling": base.with_drafter(drafter("recycling"), k, adaptive=True),
        "recycling, warm": base.with_drafter(drafter("recycling"), k, adaptive=True),
    }


def _table(engine: SpeculativeEngine) -> torch.Tensor | None:
    """The recycling table's token ids, where the engine's drafter has one."""
    table = getattr(engine.drafter, "table", None)
    return table.ids if table is not None else None


def run(args) -> str:
    torch.manual_seed(0)
    base = SpeculativeEngine.from_pretrained(device="cpu", dtype=args.dtype, cache=NO_CACHE)
    engines = systems(base, args.k)
    if args.warm:
        engines["recycling, warm"].generate(warm_prompts(args.warm), max_new_tokens=args.new_tokens, chat=True)
    kinds = {"open": OPEN, "grounded": GROUNDED}
    rows: dict[tuple[str, str], list] = {}
    for engine in engines.values():  # warm the shapes each system runs
        engine.generate([WARM_ASKS[0].format("clouds")], max_new_tokens=16, chat=True)
    for kind, prompts in kinds.items():
        for prompt in prompts:
            ids = base.encode(prompt, chat=True)
            best: dict[str, object] = {}
            tables = {name: _table(engine).clone() for name, engine in engines.items() if _table(engine) is not None}
            for _ in range(args.repeats):
                for name, engine in engines.items():
                    if name in tables:  # a repeat must not draft from what its own earlier run taught the table
                        _table(engine).copy_(tables[name])
                    result = engine.generate([ids], max_new_tokens=args.new_tokens)[0]
                    if name not in best or result.stats.tokens_per_second > best[name].stats.tokens_per_second:
                        best[name] = result
            reference = best["target-only"].token_ids
            for name, result in best.items():
                rows.setdefault((kind, name), []).append(
                    (result.stats.tokens_per_second, result.stats.mean_accepted_length, result.token_ids == reference)
                )
            print(kind, prompt[:40], {n: round(r.stats.tokens_per_second, 1) for n, r in best.items()}, flush=True)
    return report(rows, base, args)


def report(rows: dict, base: SpeculativeEngine, args) -> str:
    lines = [
        f"Default model, {base.precision}, {torch.get_num_threads()} threads, {cpu_name()}; greedy, "
        f"{args.new_tokens} new tokens, chat template, best of {args.repeats} per prompt, systems interleaved per "
        f"prompt, caches off; tree drafters with at most {args.k} nodes; warm table: {args.warm} other requests first.",
        "",
        "| prompts | system | tok/s (mean over prompts) | vs target-only | worst prompt vs target-only "
        "| tokens per forward | outputs identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in ("open", "grounded"):
        baseline = [r[0] for r in rows[(kind, "target-only")]]
        for (k, name), results in rows.items():
            if k != kind:
                continue
            speeds = [r[0] for r in results]
            ratios = [s / b for s, b in zip(speeds, baseline)]
            same = sum(r[2] for r in results)
            lines.append(
                f"| {kind} ({len(results)}) | {name} | {statistics.mean(speeds):.1f} | "
                f"{statistics.mean(speeds) / statistics.mean(baseline):.2f}x | {min(ratios):.2f}x | "
                f"{statistics.mean(r[1] for r in results):.2f} | {same}/{len(results)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--k", type=int, default=16, help="most nodes of a tree")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    text = run(args)
    print(text)
    if args.out:
        args.out.write_text(f"    .venv/bin/python benchmarks/trees.py {' '.join(_argv())}\n\n{text}")


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


if __name__ == "__main__":
    main()
