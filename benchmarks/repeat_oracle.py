"""How much of a repeat workload any history-based drafter could draft: after the history of
`specdecode bench --workload repeat` (every first turn, answered once into the draft store),
the share of the target's greedy tokens, on near-repeats and multi-turn revisions, that the
store's one-token proposal gets right. With hits that sparse a step emits about 1 / (1 - share)
tokens, whatever the draft length.

    .venv/bin/python benchmarks/repeat_oracle.py [--prompts-per-category 4] [--max-new-tokens 48] [--out FILE]
"""

from __future__ import annotations

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.repeat import near, prompt_ids, prompt_sets
from specdecode.bench.scripts import script_parser, write_table
from specdecode.drafters.suffix import SuffixDrafter


def main() -> None:
    parser = script_parser(__doc__, prompts_per_category=4, max_new_tokens=48)
    args = parser.parse_args()
    new_tokens = args.max_new_tokens
    engine = SpeculativeEngine.from_pretrained(
        drafter="none",
        device="cpu",
        dtype="bfloat16",
        cache=CacheOptions(draft_store=False, response_cache=False, prefix_cache=False),
    )
    store = engine.open_caches(CacheOptions(response_cache=False, prefix_cache=False))
    learner, plain = engine.with_drafter(SuffixDrafter(store), 8, adaptive=True), engine.with_drafter(None, 0)
    seen, _ = prompt_sets(args.prompts_per_category)
    answers = {}
    for row in seen:
        first = [{"role": "user", "content": row["turns"][0]}]
        answers[row["question_id"]] = learner.generate([prompt_ids(engine, first)], max_new_tokens=new_tokens)[0].text
    lines = []
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
            sequence = prompt + plain.generate([prompt], max_new_tokens=new_tokens)[0].token_ids
            for i in range(len(prompt), len(sequence)):
                total += 1
                hits += store.propose(sequence[:i], 1) == [sequence[i]]
        lines.append(f"{kind}: the store proposes the next token for {hits}/{total} = {hits / total:.0%}")
    write_table("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
