"""`auto` with the shipped head's layer in C against the same head's layer on torch operations
(drafters/head_kernel.py), and target-only decoding, in one process: the three alternated per
prompt, their order rotated, on chat prompts written for the scripts, never Spec-Bench:
OPEN_CHAT_PROMPTS and OPEN_PROMPTS (open-ended), DRAFTER_PROMPTS["copy"] (answers that copy the
prompt). Every output is checked against target-only's.

    .venv/bin/python benchmarks/head_layer.py [--rounds 2] [--max-new-tokens 64] [-k 4]
        [--quantization w8a8] [--out FILE]
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from specdecode import SpeculativeEngine
from specdecode.bench.environment import cpu_name
from specdecode.bench.prompts import DRAFTER_PROMPTS, OPEN_CHAT_PROMPTS, OPEN_PROMPTS
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.drafters.auto import candidates_of
from specdecode.drafters.head import HeadDrafter, for_drafting

PROMPTS = {"open-ended": list(dict.fromkeys([*OPEN_CHAT_PROMPTS, *OPEN_PROMPTS])), "copy": DRAFTER_PROMPTS["copy"]}


def engines(args) -> dict[str, tuple[SpeculativeEngine, bool]]:
    """The systems: (engine, speculative). Two engines, so that each auto measures its own costs."""

    def load() -> SpeculativeEngine:
        return SpeculativeEngine.from_pretrained(
            device="cpu", dtype="auto", cache=NO_CACHE, drafter="auto", num_speculative_tokens=args.k,
            quantization=args.quantization,
        )  # fmt: skip

    in_c, on_torch = load(), load()
    [head] = [c for c in candidates_of(on_torch.drafter) if isinstance(c, HeadDrafter)]
    head.fast = for_drafting(head.head, layer_in_c=False)  # forks share it
    return {
        "target-only": (in_c, False),
        "auto, head layer in C": (in_c, True),
        "auto, head layer on torch": (on_torch, True),
    }


def run(args) -> str:
    systems = engines(args)
    names = list(systems)
    base = systems["target-only"][0]
    prompts = [(kind, base.encode(p, chat=True)) for kind, texts in PROMPTS.items() for p in texts]
    for engine, speculative in systems.values():  # warm the shapes and the policies
        engine.generate([prompts[0][1]], max_new_tokens=16, speculative=speculative)
    totals = defaultdict(lambda: [0.0, 0, 0])  # (kind, system) -> seconds, tokens, target forwards
    for round_ in range(args.rounds):
        for i, (kind, prompt) in enumerate(prompts):
            turn = (i + round_) % len(names)
            reference = None
            for name in names[turn:] + names[:turn]:
                engine, speculative = systems[name]
                start = time.perf_counter()
                [result] = engine.generate([prompt], max_new_tokens=args.max_new_tokens, speculative=speculative)
                seconds = time.perf_counter() - start
                reference = reference or result.token_ids
                if result.token_ids != reference:
                    raise AssertionError(f"{name}'s output differs from the others' on prompt {i}")
                total = totals[(kind, name)]
                total[0] += seconds
                total[1] += len(result.token_ids)
                total[2] += result.stats.target_forwards
    lines = [
        f"Default model, {base.precision}, {torch.get_num_threads()} threads, {cpu_name()}; greedy, "
        f"{args.max_new_tokens} new tokens, chat template, {args.rounds} rounds, caches off; auto k <= {args.k}; "
        "every output identical to target-only's.",
        "",
        "Tokens per second (against target-only), tokens per target forward.",
        "",
        "| prompts | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for kind, texts in PROMPTS.items():
        base_rate = totals[(kind, names[0])][1] / totals[(kind, names[0])][0]
        cells = []
        for name in names:
            seconds, tokens, forwards = totals[(kind, name)]
            cells.append(f"{tokens / seconds:.1f} ({tokens / seconds / base_rate:.2f}x), {tokens / forwards:.2f}")
        lines.append(f"| {kind} ({len(texts)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=64, k=4, rounds=2)
    parser.add_argument("--quantization", default="w8a8", help="the target's [default: w8a8]")
    args = parser.parse_args()
    write_table(run(args), args.out)


if __name__ == "__main__":
    main()
