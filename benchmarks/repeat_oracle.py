"""How much of a repeat workload any history-based drafter could draft: after the history of
`specdecode bench --workload repeat` (every first turn, answered once into the draft store),
the share of the target's greedy tokens, on near-repeats and multi-turn revisions, that the
store's one-token proposal gets right. With hits that sparse a step emits about 1 / (1 - share)
tokens, whatever the draft length.

    .venv/bin/python benchmarks/repeat_oracle.py [--prompts 4] [--new-tokens 48]
"""

from __future__ import annotations

import argparse

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.repeat import near, prompt_ids, prompt_sets
from specdecode.drafters.suffix import SuffixDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    engine = SpeculativeEngine.from_pretrained(
        drafter="none", device="cpu", dtype="bfloat16", cache=CacheOptions(draft_store=False, response_cache=False)
    )
    store = engine.open_caches(CacheOptions(response_cache=False))
    learner, plain = engine.with_drafter(SuffixDrafter(store), 8, adaptive=True), engine.with_drafter(None, 0)
    seen, _ = prompt_sets(args.prompts)
    answers = {}
    for row in seen:
        first = [{"role": "user", "content": row["turns"][0]}]
        answers[row["question_id"]] = learner.generate([prompt_ids(engine, first)], args.new_tokens)[0].text
    for kind in ("near-repeat", "multi-turn revision"):
        hits = total = 0
        for row in seen:
            first = {"role": "user", "content": row["turns"][0]}
            messages = (
                [{"role": "user", "content": near(row["turns"][0])}]
                if kind == "near-repeat"
                else [first, {"role": "assistant", "content": answers[row["question_id"]]}]
                + [{"role": "user", "content": row["turns"][1]}]
            )
            prompt = prompt_ids(engine, messages)
            sequence = prompt + plain.generate([prompt], args.new_tokens)[0].token_ids
            for i in range(len(prompt), len(sequence)):
                total += 1
                hits += store.propose(sequence[:i], 1) == [sequence[i]]
        print(f"{kind}: the store proposes the next token for {hits}/{total} = {hits / total:.0%}")


if __name__ == "__main__":
    main()
