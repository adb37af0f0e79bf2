"""`specdecode bench --workload repeat`: repetition as users bring it, the caching layer
(response cache, draft store, `suffix`) against target-only decoding and prompt lookup, in one run.

Workloads, each over the same Spec-Bench prompts (the shipped subset's multi-turn ones):
(a) exact repeats of a prompt answered before; (b) near-repeats: the same prompt with one
detail changed; (c) multi-turn: MT-bench's second turn (mostly "revise your answer") after
the first turn and its answer; (d) unique prompts, never seen, as the control. The history
(every first turn, answered once) is decoded first and fills the draft store and the
response cache; then each measured request runs once per system, in a new random order per
request, and every output is compared with target-only decoding's. The store learns nothing
during the measurement, so no system drafts from another's answer to the same request.
Greedy; the chat template where the model has one.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Callable

from specdecode.bench.environment import cpu_name
from specdecode.bench.interleave import interleave
from specdecode.bench.prompts import default_prompt_file
from specdecode.bench.tables import markdown_table
from specdecode.drafters import AutoDrafter, PromptLookupDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.engine import CacheOptions, GenerationResult, SpeculativeEngine

WORKLOADS = ("exact repeat", "near-repeat", "multi-turn revision", "unique")
Messages = list[dict[str, str]]


def prompt_sets(count: int) -> tuple[list[dict], list[dict]]:
    """count multi-turn Spec-Bench rows (the history and its repeats), and count others (unique)."""
    with open(default_prompt_file()) as lines:
        rows = [json.loads(line) for line in lines]
    multi = [r for r in rows if len(r.get("turns", [])) > 1][:count]
    return multi, [r for r in rows if r not in multi][:count]


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


def run_repeat_workload(
    engine: SpeculativeEngine,
    prompts: int,
    new_tokens: int,
    seed: int = 0,
    on_request: Callable[[], None] = lambda: None,
) -> str:
    """The Markdown table of every workload and system. engine: loaded with its caches off
    (CacheOptions(draft_store=False)); the store and response cache are opened here."""
    store = engine.open_caches(
        CacheOptions(response_cache=False, prefix_cache=False)
    )  # the draft store on the engine's backend
    learner = engine.with_drafter(SuffixDrafter(store), 8, adaptive=True, response_cache=True)

    def generate(view: SpeculativeEngine, messages: Messages) -> GenerationResult:
        return view.generate([prompt_ids(engine, messages)], max_new_tokens=new_tokens)[0]

    seen, unseen = prompt_sets(prompts)
    history = {row["question_id"]: generate(learner, _first_turn(row)).text for row in seen}
    requests = _requests(seen, unseen, history)
    views = systems(engine, store)
    for view in views.values():  # warm-up: first calls, first measurements
        generate(view, [{"role": "user", "content": "Say hello."}])
    answered = itertools.count(1)

    def timing(view: SpeculativeEngine) -> Callable[[Messages], GenerationResult]:
        def run(messages: Messages) -> GenerationResult:
            result = generate(view, messages)
            if next(answered) % len(views) == 0:  # every system has answered this request
                on_request()
            return result

        return run

    items = [messages for _, messages in requests]
    runs = interleave({name: timing(view) for name, view in views.items()}, items, order="shuffle", seed=seed)
    totals = defaultdict(lambda: defaultdict(float))
    baseline = {run.item: run.value.token_ids for run in runs if run.system == "target-only"}
    for run in runs:
        cell = totals[(requests[run.item][0], run.system)]
        _add(cell, run.value, run.seconds, run.value.token_ids == baseline[run.item])
    return _table(totals, views, prompts, new_tokens)


def request_count(prompts: int) -> int:
    seen, unseen = prompt_sets(prompts)
    return 3 * len(seen) + len(unseen)


def _first_turn(row: dict) -> Messages:
    return [{"role": "user", "content": row["turns"][0]}]


def _requests(seen: list[dict], unseen: list[dict], history: dict) -> list[tuple[str, Messages]]:
    requests = []
    for row in seen:
        turn = _first_turn(row)
        requests.append(("exact repeat", turn))
        requests.append(("near-repeat", [{"role": "user", "content": near(row["turns"][0])}]))
        answer = {"role": "assistant", "content": history[row["question_id"]]}
        requests.append(("multi-turn revision", turn + [answer, {"role": "user", "content": row["turns"][1]}]))
    return requests + [("unique", _first_turn(row)) for row in unseen]


def prompt_ids(engine: SpeculativeEngine, messages: Messages) -> list[int]:
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:  # a base model: the messages' contents, one a line, as the server continues them
        text = "\n".join(m["content"] for m in messages)
    return tokenizer(text, add_special_tokens=False).input_ids


def _add(cell: dict, result: GenerationResult, seconds: float, identical: bool) -> None:
    cell["tokens"] += len(result.token_ids)
    cell["seconds"] += seconds
    cell["identical"] += identical
    cell["requests"] += 1
    cell["forwards"] += result.stats.target_forwards
    cell["cached"] += result.stats.cached


def _table(totals: dict, views: dict, prompts: int, new_tokens: int) -> str:
    header = ["workload", "system", "tok/s", "x target-only", "tokens/forward", "cached", "identical to target-only"]
    rows = []
    for workload in WORKLOADS:
        base = totals[(workload, "target-only")]
        for name in views:
            cell = totals[(workload, name)]
            if not cell["requests"]:
                continue
            rate, base_rate = cell["tokens"] / cell["seconds"], base["tokens"] / base["seconds"]
            per_forward = cell["tokens"] / cell["forwards"] if cell["forwards"] else float("nan")
            requests = int(cell["requests"])
            rows.append(
                [workload, name, f"{rate:.1f}", f"{rate / base_rate:.2f}x", f"{per_forward:.2f}"]
                + [f"{int(cell['cached'])}/{requests}", f"{int(cell['identical'])}/{requests}"]
            )
    title = (
        f"Repeat workloads, {cpu_name()}, greedy, {new_tokens} new tokens, {prompts} prompts per workload, "
        f"`specdecode bench --workload repeat --prompts-per-category {prompts} --max-new-tokens {new_tokens}`"
    )
    return f"{title}\n\n{markdown_table(header, rows)}"
