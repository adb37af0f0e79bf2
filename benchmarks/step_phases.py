"""Where a decoding step's time goes, phase by phase (decoder.py's phases): target-only against
`auto` (the shipped head among its drafters), one sequence at a time or a batch, greedy or
sampled, in one process, the two alternated every round.

Each `Decoder` phase is wrapped with a timer; a cell is milliseconds per step of that phase,
summed over OPEN_CHAT_PROMPTS (bench/prompts.py: written for the scripts, never Spec-Bench)
and the rounds. `learn` runs in target-only decoding too: `auto`'s drafters learn from every
step, drafting or not.

    .venv/bin/python benchmarks/step_phases.py [--batch 8] [--temperature 0] [-k 4] [--rounds 2]
        [--max-new-tokens 64] [--dtype auto] [--quantization w8a8] [--out FILE]
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from specdecode import SpeculativeEngine
from specdecode.bench.environment import cpu_name
from specdecode.bench.prompts import OPEN_CHAT_PROMPTS
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.decoder import Decoder

PHASES = ("_roll_back", "_draft", "_verify", "_decide", "_keep_path", "_learn", "_commit")


class PhaseTimer:
    """Wraps Decoder.step and its phases (on the class: every engine's decoder) with timers."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        for name in ("step", *PHASES):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        original = getattr(Decoder, name)

        def timed(decoder, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(decoder, *args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.steps += name == "step"

        setattr(Decoder, name, timed)

    def take(self) -> tuple[dict[str, float], int]:
        """What was measured since the last take, and the steps it covered."""
        seconds, steps = dict(self.seconds), self.steps
        self.seconds.clear()
        self.steps = 0
        return seconds, steps


def run(args) -> str:
    engine = SpeculativeEngine.from_pretrained(
        device="cpu", dtype=args.dtype, cache=NO_CACHE, drafter="auto", num_speculative_tokens=args.k,
        quantization=args.quantization,
    )  # fmt: skip
    prompts = [engine.encode(p, chat=True) for p in OPEN_CHAT_PROMPTS]
    sampling = dict(temperature=args.temperature)
    timer = PhaseTimer()

    def decode(speculative: bool, max_new_tokens: int):
        batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
        return [
            result
            for batch in batches
            for result in engine.generate(
                batch, max_new_tokens=max_new_tokens, max_batch_size=args.batch, speculative=speculative, **sampling
            )
        ]

    for speculative in (False, True):  # warm the shapes and the policies
        decode(speculative, 16)
    timer.take()
    totals = {False: [defaultdict(float), 0, 0, 0.0], True: [defaultdict(float), 0, 0, 0.0]}
    for _ in range(args.rounds):
        for speculative in (False, True):
            start = time.perf_counter()
            results = decode(speculative, args.max_new_tokens)
            total = totals[speculative]
            total[3] += time.perf_counter() - start
            seconds, steps = timer.take()
            for name, value in seconds.items():
                total[0][name] += value
            total[1] += steps
            total[2] += sum(len(r.token_ids) for r in results)
    lines = [
        f"Default model, {engine.precision}, {torch.get_num_threads()} threads, {cpu_name()}; "
        f"{len(prompts)} prompts (OPEN_CHAT_PROMPTS) in batches of {args.batch}, temperature {args.temperature:g}, "
        f"{args.max_new_tokens} new tokens, chat template, {args.rounds} rounds alternated, caches off; auto k <= {args.k}.",
        "",
        "Milliseconds per step (one target forward for the whole batch), by phase; tokens per second over the run.",
        "",
        "| system | tok/s | tokens per step | step | "
        + " | ".join(p.strip("_").replace("_", " ") for p in PHASES)
        + " |",
        "|---" * (len(PHASES) + 4) + "|",
    ]
    for speculative, (seconds, steps, tokens, wall) in totals.items():
        cells = [f"{seconds[name] * 1e3 / steps:.2f}" for name in ("step", *PHASES)]
        name = "auto" if speculative else "target-only"
        lines.append(f"| {name} | {tokens / wall:.1f} | {tokens / steps:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=64, k=4, rounds=2, dtype="auto")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together [default: 1]")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy [default: 0]")
    parser.add_argument("--quantization", default=None, help="the target's, e.g. w8a8 [default: none]")
    args = parser.parse_args()
    write_table(run(args), args.out)


if __name__ == "__main__":
    main()
