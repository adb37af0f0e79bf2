"""What prefix reuse (runners/slots.py) saves a chat: the time to the first token of a first turn
(a new question after another one: they share the chat template's system prompt), of a
second turn (the conversation so far, then a new question), and of 4 choices of that second
turn asked at once from empty slots (one prefill, copied: decoder.Decoder._shared_prefills),
with the slots' kept prefixes and without, on the default engine, in one process, alternated
prompt by prompt.

Prompts: OPEN_CHAT_PROMPTS (bench/prompts.py: written for the scripts, never Spec-Bench), each
followed by the next as its second turn. Time to first token: a generation of one new token.

    .venv/bin/python benchmarks/prefix_reuse.py [--rounds 3] [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import statistics
import time

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.bench.environment import cpu_name
from specdecode.bench.prompts import OPEN_CHAT_PROMPTS
from specdecode.bench.scripts import script_parser, write_table

CACHES = CacheOptions(response_cache=False, draft_store=False)  # prefix reuse decided per system below


def first_token_seconds(engine: SpeculativeEngine, prompt: str, choices: int = 1) -> tuple[float, int, int]:
    """Seconds to the first token (of `choices` sequences of the prompt decoded together, as a
    request's n), the prompt's tokens and those reused."""
    start = time.perf_counter()
    result, *_ = engine.generate([prompt] * choices, max_new_tokens=1, max_batch_size=choices)
    return time.perf_counter() - start, len(result.prompt_token_ids), result.stats.prompt_tokens_reused


def one_chat(engine: SpeculativeEngine, first: str, second: str, max_new_tokens: int) -> dict[str, tuple]:
    """A first turn's first token (after another chat's), its answer, then the second turn's first token."""
    timings = {"first turn": first_token_seconds(engine, engine.chat_prompt([{"role": "user", "content": first}]))}
    (answer,) = engine.generate(
        [engine.chat_prompt([{"role": "user", "content": first}])], max_new_tokens=max_new_tokens
    )
    conversation = [
        {"role": "user", "content": first},
        {"role": "assistant", "content": answer.text},
        {"role": "user", "content": second},
    ]
    timings["second turn"] = first_token_seconds(engine, engine.chat_prompt(conversation))
    engine.decoder.slots.forget_prefixes()  # the choices share their prefill, not the turn's cache
    timings["second turn, 4 choices"] = first_token_seconds(engine, engine.chat_prompt(conversation), choices=4)
    return timings


def run(args) -> str:
    engine = SpeculativeEngine.from_pretrained(cache=CACHES)
    systems = {"kept prefixes": engine.with_drafter(engine.drafter, engine.num_speculative_tokens, adaptive=True)}
    systems["none kept"] = engine.with_drafter(engine.drafter, engine.num_speculative_tokens, adaptive=True)
    systems["none kept"].decoder.slots.reuse_prefixes(False)
    assert systems["kept prefixes"].decoder.slots.reuses_prefixes, "this engine's runner reuses no prefixes"
    seen: dict[tuple[str, str], list[tuple]] = {}
    prompts = list(OPEN_CHAT_PROMPTS)
    for round_ in range(args.rounds):
        for i, first in enumerate(prompts):
            order = list(systems) if (i + round_) % 2 == 0 else list(systems)[::-1]
            for name in order:
                for case, timing in one_chat(
                    systems[name], first, prompts[(i + 1) % len(prompts)], args.max_new_tokens
                ).items():
                    seen.setdefault((name, case), []).append(timing)
    lines = [
        f"{engine.precision}, {cpu_name()}; {len(prompts)} chats x {args.rounds} rounds, alternated; "
        f"first answers of {args.max_new_tokens} tokens at most.",
        "",
        "| turn | prompt tokens (mean) | reused (mean) | first token, none kept (median ms) | kept prefixes | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for case in ("first turn", "second turn", "second turn, 4 choices"):
        off, on = seen[("none kept", case)], seen[("kept prefixes", case)]
        off_ms, on_ms = (1e3 * statistics.median(t[0] for t in runs) for runs in (off, on))
        tokens, reused = statistics.mean(t[1] for t in on), statistics.mean(t[2] for t in on)
        lines.append(f"| {case} | {tokens:.0f} | {reused:.0f} | {off_ms:.1f} | {on_ms:.1f} | {on_ms / off_ms:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=64, rounds=3)
    args = parser.parse_args()
    write_table(run(args), args.out)


if __name__ == "__main__":
    main()
