"""Draft trees on held-out chat prompts, in one run: target-only against each drafter.

The prompts below were written for this benchmark (none comes from Spec-Bench or any set a
drafter learns from): 12 open-ended ones, where the answer is new text, and 6 input-grounded
ones, where it copies or edits the prompt. Every system runs every prompt, interleaved per
prompt (the machine is shared and noisy), best of `--repeats` per prompt; every output is
checked against target-only decoding of the same engine (same precision). Systems:
- target-only;
- prompt-lookup: the default drafter before trees on open prompts (chains, adaptive k);
- recycling: the target's own predictions as a tree (drafters/recycling.py), adaptive size;
  its table is shared by the requests, so it starts empty and learns from the measured prompts
  that came before (never from the same prompt: each repeat starts from the table as it was);
- recycling, warm: the same after the table learnt from `--warm` other requests (a server
  that has run a while; the warm-up prompts are generated, not the measured ones).

    .venv/bin/python benchmarks/trees.py [--new-tokens 64] [--repeats 2] [--warm 40] [--k 16]
        [--out benchmarks/results/trees.md]

`--replay N` measures tokens per forward alone, which the machine's load does not change: the
target's greedy answers to N tuning prompts (generated, as the warm-up ones) and to the
measured prompts are replayed through the recycling drafter, its table written from each
answer's true path only (a lower bound: the engine also writes the rejected nodes' rows). It
prints each tree depth's acceptance by rank, fitted on the tuning answers (the prior that
shapes the tree: RANK_ACCEPTANCE in drafters/recycling.py), and the measured prompts' tokens
per forward with the shipped prior and the fitted one, for several tree sizes, with the table
cold and warmed by the tuning answers.

    .venv/bin/python benchmarks/trees.py --replay 40 [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.environment import cpu_name

NO_CACHE = CacheOptions(response_cache=False, draft_store=False, prefix_cache=False)

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


# --- replay: tokens per forward without timing ---

TOP = 16  # candidates kept per position of a replayed answer (the widest table replayed)


def answers(base: SpeculativeEngine, prompts: list[str], new_tokens: int) -> list[dict]:
    """Each prompt's ids, the target's greedy answer, and its TOP candidates [len, TOP] after
    every position of prompt + answer (one forward over the whole text)."""
    from specdecode.drafters.factory import DrafterOptions, make_drafter

    drafter = make_drafter("recycling", None, base.target_runner, base.tokenizer, None, "auto", DrafterOptions())
    engine = base.with_drafter(drafter, 8, adaptive=False)  # the same answers, in fewer forwards
    runner, data = base.target_runner, []
    for prompt in prompts:
        ids = base.encode(prompt, chat=True)
        answer = engine.generate([ids], max_new_tokens=new_tokens)[0].token_ids
        runner.reset()
        logits = runner.forward(torch.tensor(ids + answer), len(ids) + len(answer))  # [len, vocab]
        runner.reset()
        data.append(dict(prompt=ids, answer=answer, top=logits.float().topk(TOP, dim=-1).indices.to(torch.int32)))
        print("answered", len(data), "of", len(prompts), flush=True)
    return data


def accepted_path(tokens: list[int], parents: list[int], truth: list[int]) -> list[int]:
    """The greedy tree rule against the known answer: the nodes, root to leaf, that equal it."""
    node, path = -1, []
    for token in truth:
        child = next((i for i, p in enumerate(parents) if p == node and tokens[i] == token), None)
        if child is None:
            break
        path.append(child)
        node = child
    return path


def replay(data: list[dict], vocab: int, k: int, acceptance, table=None, width: int = 8) -> tuple[float, object]:
    """Tokens per forward (the prefill's counted, as GenerationStats counts them) of the recycling
    drafter with k nodes over the answers in order (one table for all, as a server's), and the table."""
    from specdecode.core.sampling import SamplingParams
    from specdecode.drafters.prompt_lookup import PromptLookupDrafter
    from specdecode.drafters.recycling import RecyclingDrafter

    drafter = RecyclingDrafter(vocab, width, PromptLookupDrafter(tree=True), table=table, rank_acceptance=acceptance)
    tokens_out = forwards = 0
    for item in data:
        prompt, answer, top = item["prompt"], item["answer"], item["top"][:, :width]
        drafter.begin(prompt)
        drafter.table.ids[prompt[-1]] = top[len(prompt) - 1]  # the prefill's row
        done = 1
        forwards += 1
        while done < len(answer):
            context = prompt + answer[:done]
            budget = min(k, len(answer) - done - 1)
            draft = drafter.propose(context, budget, SamplingParams(0.0), None) if budget > 0 else None
            nodes, parents = (draft.tokens.tolist(), draft.parent_list()) if draft is not None else ([], [])
            path = accepted_path(nodes, parents, answer[done:])
            rows = {}  # token -> position of its first occurrence on the true path
            for token, position in zip([context[-1]] + [nodes[i] for i in path], range(len(context) - 1, 10**9)):
                rows.setdefault(token, position)
            drafter.table.ids[list(rows)] = top[list(rows.values())]
            count_lookup(drafter, nodes, parents, path, answer[done:])
            done += len(path) + 1
            forwards += 1
        drafter.finish(prompt + answer)
        tokens_out += len(answer)
    return tokens_out / forwards, drafter.table


def count_lookup(drafter, nodes: list[int], parents: list[int], path: list[int], truth: list[int]) -> None:
    """The drafter's prompt-lookup rate, as its learn counts it: the target's next token is known
    after the root and the accepted nodes, which are all the rows the count reads."""
    proposed, drafter._proposed = drafter._proposed, None
    if proposed is None or not proposed[2]:
        return
    predicted = [truth[0]] + [-1] * len(nodes)
    for depth, node in enumerate(path, start=1):
        predicted[node + 1] = truth[depth] if depth < len(truth) else -1
    drafter._count_lookup(nodes, parents, proposed[2], predicted)


def rank_acceptance(data: list[dict], vocab: int, depths: int = 4, width: int = 8):
    """At every position of the answers, with the table as a replay holds it then: the chance
    that the next token is the table's rank r candidate after the token before it, given that
    the answer's tokens up to there were in the table (the path reached that depth), by depth."""
    from specdecode.drafters.recycling import TokenTable

    table = TokenTable(vocab, width)
    hits, tries = [[0] * width for _ in range(depths)], [0] * depths
    for item in data:
        prompt, answer, top = item["prompt"], item["answer"], item["top"][:, :width]
        full = prompt + answer
        for done in range(len(answer)):
            table.ids[full[len(prompt) + done - 1]] = top[len(prompt) + done - 1]
            for depth in range(min(depths, len(answer) - done - 1)):
                row = table.ids[full[len(prompt) + done + depth]].tolist()
                tries[depth] += 1
                token = answer[done + depth + 1]
                if token not in row:
                    break
                hits[depth][row.index(token)] += 1
    return tuple(tuple(round(h / max(t, 1), 3) for h in level) for level, t in zip(hits, tries)), tries


def run_replay(args) -> str:
    from specdecode.drafters.recycling import RANK_ACCEPTANCE

    base = SpeculativeEngine.from_pretrained(device="cpu", dtype=args.dtype, cache=NO_CACHE)
    vocab = base.target_runner.vocab_size
    sets = {"tuning": warm_prompts(args.replay), "open": OPEN, "grounded": GROUNDED}
    data = {name: answers(base, prompts, args.new_tokens) for name, prompts in sets.items()}
    fitted, tries = rank_acceptance(data["tuning"], vocab)
    lines = [
        f"Replay (table written from the true path only), default model, {base.precision}, greedy, "
        f"{args.new_tokens} new tokens, chat template; prior fitted on {args.replay} tuning answers.",
        "",
        "Fitted acceptance by rank, per depth (positions tried): "
        + "; ".join(f"depth {d + 1} ({t}): {level}" for d, (level, t) in enumerate(zip(fitted, tries))),
        "",
        "| prompts | prior | table | " + " | ".join(f"k {k}" for k in REPLAY_SIZES) + " |",
        "|---|---|---|" + "---|" * len(REPLAY_SIZES),
    ]
    for kind in ("open", "grounded"):
        for name, prior in (("RANK_ACCEPTANCE", RANK_ACCEPTANCE), ("fitted", fitted)):
            for warm in (False, True):
                cells = []
                for k in REPLAY_SIZES:
                    table = replay(data["tuning"], vocab, k, prior)[1] if warm else None
                    cells.append(f"{replay(data[kind], vocab, k, prior, table)[0]:.3f}")
                lines.append(f"| {kind} | {name} | {'warm' if warm else 'cold'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


REPLAY_SIZES = (4, 8, 16, 24)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warm", type=int, default=40)
    parser.add_argument("--k", type=int, default=16, help="most nodes of a tree")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--replay", type=int, default=0, help="replay N tuning answers: tokens per forward only")
    args = parser.parse_args()
    text = run_replay(args) if args.replay else run(args)
    print(text)
    if args.out:
        args.out.write_text(f"    .venv/bin/python benchmarks/trees.py {' '.join(_argv())}\n\n{text}")


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


if __name__ == "__main__":
    main()
