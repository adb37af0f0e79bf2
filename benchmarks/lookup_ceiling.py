"""The most prompt lookup can gain on the drafters benchmark's prompts, replayed on their answers.

For each prompt, the target's greedy answer (target-only decoding, chat template on). Then
prompt lookup is replayed against it with a fixed k: each step drafts from the tokens so far,
keeps the draft tokens that equal the answer, and adds one, as verification would. The steps
priced at the forward costs measured here (`runners.profiling.profile_forward`) plus the prompt's
prefill give the speculative time; target-only pays one one-token forward per answer token.
The last column prices every step as a one-token forward: no faster verification can beat it,
so it bounds what prompt lookup can reach on these answers whatever the hardware.

    .venv/bin/python benchmarks/lookup_ceiling.py [--dtype float32] [--max-new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import torch

from specdecode import SpeculativeEngine
from specdecode.bench.prompts import DRAFTER_PROMPTS
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.core.sampling import SamplingParams
from specdecode.drafters import PromptLookupDrafter
from specdecode.runners.profiling import measure_hardware, median_seconds, profile_forward

KS = (2, 4, 8, 12, 16)


def lookup_steps(prompt: list[int], answer: list[int], k: int) -> list[int]:
    """Tokens each step's target forward verifies when prompt lookup drafts up to k tokens."""
    drafter, done, verified = PromptLookupDrafter(), 0, []
    drafter.begin(prompt)
    while done < len(answer):
        draft = drafter.propose(prompt + answer[:done], k, SamplingParams(), None).tokens.tolist() if done else []
        accepted = 0
        while accepted < len(draft) and done + accepted < len(answer) and draft[accepted] == answer[done + accepted]:
            accepted += 1
        verified.append(len(draft) + 1)
        done += accepted + 1
    return verified


def main() -> None:
    parser = script_parser(__doc__, dtype="float32", max_new_tokens=64)
    args = parser.parse_args()
    engine = SpeculativeEngine.from_pretrained(
        "smollm2-135m-instruct", drafter="none", device="cpu", dtype=args.dtype, cache=NO_CACHE, keep_model_weights=True
    )
    runner, model = engine.target_runner, engine.target_runner.model
    hardware = measure_hardware(model.dtype)
    costs = {
        c.new_tokens: c.seconds
        for c in profile_forward(runner, model, hardware, tuple(range(1, max(KS) + 2)), prefix=100)
    }
    rows = []
    for kind, prompts in DRAFTER_PROMPTS.items():
        answers = []
        for prompt in prompts:
            ids = engine.encode(prompt, chat=True)
            answer = engine.generate([ids], max_new_tokens=args.max_new_tokens, speculative=False)[0].token_ids
            prefill = median_seconds(lambda: (runner.reset(), runner.forward(torch.tensor(ids), 1)), repeats=3)  # noqa: B023
            answers.append((ids, answer, prefill))
        target_only = sum(prefill + len(answer) * costs[1] for _, answer, prefill in answers)
        for k in KS:
            steps = [lookup_steps(ids, answer, k) for ids, answer, _ in answers]
            measured = sum(p + sum(costs[n] for n in s) for (_, _, p), s in zip(answers, steps))
            free = sum(p + len(s) * costs[1] for (_, _, p), s in zip(answers, steps))
            tokens = sum(len(a) for _, a, _ in answers) / sum(len(s) for s in steps)
            rows.append([kind, k, f"{tokens:.2f}", f"{target_only / measured:.2f}x", f"{target_only / free:.2f}x"])
    header = [
        "prompts",
        "k",
        "tokens per forward",
        "speedup at measured costs",
        "speedup if verification cost one token",
    ]
    text = "\n".join(
        [
            f"# Prompt lookup's ceiling on smollm2-135m-instruct ({args.dtype}, CPU)",
            "",
            "Forward ms by tokens verified: " + ", ".join(f"{n}: {s * 1e3:.0f}" for n, s in costs.items()) + ".",
            "",
            markdown_table(header, rows),
        ]
    )
    write_table(text, args.out)


if __name__ == "__main__":
    main()
