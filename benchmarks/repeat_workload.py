"""Repetition as users bring it: the caching layer (response cache, draft store, `suffix`)
against target-only decoding and prompt lookup, in one run.

Workloads, each over the same Spec-Bench prompts (the shipped subset, multi-turn ones):
(a) exact repeats of a prompt answered before; (b) near-repeats: the same prompt with one
detail changed; (c) multi-turn: MT-bench's second turn (mostly "revise your answer") after
the first turn and its answer; (d) unique prompts, never seen, as the control. The history
(every first turn, answered once) is decoded first and fills the draft store and the
response cache; then each measured request runs once per system, in a new random order per
request, and every output is compared with target-only decoding's. The store learns
nothing during the measurement, so no system drafts from another's answer to the same
request. Greedy, chat template on, bfloat16 (where the response cache is exact on the CPU).

    .venv/bin/python benchmarks/repeat_workload.py [--prompts 6] [--new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections import defaultdict

from report import emit
from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.prompts import default_prompt_file
from specdecode.drafters import AutoDrafter, PromptLookupDrafter
from specdecode.drafters.suffix import SuffixDrafter

WORKLOADS = ("exact repeat", "near-repeat", "multi-turn revision", "unique")


def prompt_sets(count: int) -> tuple[list[dict], list[dict]]:
    with open(default_prompt_file()) as lines:
        rows = [json.loads(line) for line in lines]
    multi = [r for r in rows if len(r.get("turns", [])) > 1]
    return multi[:count], [r for r in rows if r not in multi[:count]][:count]


def near(prompt: str) -> str:
    """The same request with one detail changed: its last word replaced."""
    head, _, last = prompt.rstrip(".?! ").rpartition(" ")
    return f"{head} {'today' if last.lower() != 'today' else 'tomorrow'}{prompt[len(prompt.rstrip('.?! ')) :]}"


def systems(engine: SpeculativeEngine, store) -> dict[str, SpeculativeEngine]:
    return {
        "target-only": engine.with_drafter(None, 0),
        "prompt lookup (adaptive k<=4)": engine.with_drafter(PromptLookupDrafter(), 4, adaptive=True),
        "suffix (adaptive k<=8)": engine.with_drafter(SuffixDrafter(store, learn=False), 8, adaptive=True),
        "auto + draft store + response cache": engine.with_drafter(
            AutoDrafter([PromptLookupDrafter(), SuffixDrafter(store, learn=False)]),
            8,
            adaptive=True,
            response_cache=True,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    engine = SpeculativeEngine.from_pretrained(
        drafter="none", device="cpu", dtype="bfloat16", cache=CacheOptions(draft_store=False)
    )
    store = engine.open_caches(CacheOptions(response_cache=False))  # the draft store on the same backend
    history_engine = engine.with_drafter(SuffixDrafter(store), 8, adaptive=True, response_cache=True)  # learns
    seen, unseen = prompt_sets(args.prompts)
    generate = dict(max_new_tokens=args.new_tokens, chat=True)

    def chat(view: SpeculativeEngine, messages: list[dict]):
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = engine.tokenizer(text, add_special_tokens=False).input_ids
        start = time.perf_counter()
        result = view.generate([ids], max_new_tokens=args.new_tokens)[0]
        return result, time.perf_counter() - start

    history = {}
    for row in seen:  # first turns, answered once: the history every later request may reuse
        first = history_engine.generate(row["turns"][0], **generate)[0]
        history[row["question_id"]] = first.text
    requests = []
    for row in seen:
        turn = [{"role": "user", "content": row["turns"][0]}]
        requests.append(("exact repeat", turn))
        requests.append(("near-repeat", [{"role": "user", "content": near(row["turns"][0])}]))
        revision = turn + [
            {"role": "assistant", "content": history[row["question_id"]]},
            {"role": "user", "content": row["turns"][1]},
        ]
        requests.append(("multi-turn revision", revision))
    requests += [("unique", [{"role": "user", "content": row["turns"][0]}]) for row in unseen]

    views = systems(engine, store)
    for view in views.values():  # warm-up: first calls, first measurements
        chat(view, [{"role": "user", "content": "Say hello."}])
    order = random.Random(args.seed)
    totals = defaultdict(lambda: defaultdict(float))
    for workload, messages in requests:
        names = list(views)
        order.shuffle(names)
        results = {name: chat(views[name], messages) for name in names}
        baseline = results["target-only"][0].token_ids
        for name, (result, seconds) in results.items():
            cell = totals[(workload, name)]
            cell["tokens"] += len(result.token_ids)
            cell["seconds"] += seconds
            cell["identical"] += result.token_ids == baseline
            cell["requests"] += 1
            cell["accepted"] += result.stats.accepted_tokens
            cell["forwards"] += result.stats.target_forwards
            cell["cached"] += result.stats.cached

    lines = [
        f"Repeat workloads, {platform.processor() or platform.machine()} ({_cpu()}), 2 threads, bfloat16, greedy, "
        f"{args.new_tokens} new tokens, {args.prompts} prompts per workload, "
        f"`.venv/bin/python benchmarks/repeat_workload.py --prompts {args.prompts} --new-tokens {args.new_tokens}`",
        "",
        "| workload | system | tok/s | x target-only | tokens/forward | cached | identical to target-only |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in WORKLOADS:
        base = totals[(workload, "target-only")]
        for name in views:
            cell = totals[(workload, name)]
            rate, base_rate = cell["tokens"] / cell["seconds"], base["tokens"] / base["seconds"]
            per_forward = cell["tokens"] / cell["forwards"] if cell["forwards"] else float("nan")
            lines.append(
                f"| {workload} | {name} | {rate:.1f} | {rate / base_rate:.2f}x | {per_forward:.2f} | "
                f"{int(cell['cached'])}/{int(cell['requests'])} | {int(cell['identical'])}/{int(cell['requests'])} |"
            )
    emit("\n".join(lines), args.out)


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


if __name__ == "__main__":
    main()
