"""How fast train-draft's data phase writes answers (issue 45, part 1): the target's answers to
Magpie instructions it wrote itself (never benchmark prompts), through the engine's batched
decoding, at several batch sizes and precisions. Each round times every (precision, batch
size) once, in a new order; answer tokens per second over all rounds.

    .venv/bin/python benchmarks/data_throughput.py [--instructions 32] [--max-new-tokens 128]
        [--batch 8,16,32] [--dtype auto,bfloat16] [--rounds 2] [--out FILE]
"""

from __future__ import annotations

import random
import time

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.scripts import script_parser, write_table
from specdecode.loading import DEFAULT_TARGET
from specdecode.training import data
from specdecode.training.evaluate import HELD_OUT


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--instructions", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch", default="8,16,32")
    parser.add_argument("--dtype", default="auto,bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    # caches off: every round answers the same instructions again
    off = CacheOptions(response_cache=False, draft_store=False, prefix_cache=False)
    engines = {
        d: SpeculativeEngine.from_pretrained(args.target, drafter="none", dtype=d, cache=off)
        for d in args.dtype.split(",")
    }
    chat = bool(getattr(next(iter(engines.values())).tokenizer, "chat_template", None))
    prompts = data.magpie_instructions(next(iter(engines.values())), args.instructions, seed=7, held_out=HELD_OUT)
    batches = [int(b) for b in args.batch.split(",")]
    cells = [(d, b) for d in engines for b in batches]
    tokens = {cell: 0 for cell in cells}
    seconds = {cell: 0.0 for cell in cells}
    order = random.Random(0)
    for _ in range(args.rounds):
        order.shuffle(cells)
        for d, b in cells:
            start = time.perf_counter()
            samples = data.answers(
                engines[d], prompts, 0, args.max_new_tokens, sampled_share=0.0, chat=chat, batch_size=b
            )
            seconds[(d, b)] += time.perf_counter() - start
            tokens[(d, b)] += sum(len(s.answer_ids) for s in samples)
    lines = [
        f"{args.target}: {len(prompts)} Magpie instructions answered greedily, {args.max_new_tokens} new tokens "
        f"at most, {args.rounds} rounds",
        "",
        "| precision | batch | answer tokens/s |",
        "|---|---|---|",
    ]
    for d, engine in engines.items():
        for b in batches:
            lines.append(f"| {engine.precision.split(' (')[0]} | {b} | {tokens[(d, b)] / seconds[(d, b)]:.0f} |")
    write_table("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
