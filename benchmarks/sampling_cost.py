"""Milliseconds to draw one token from one row of the default model's vocabulary (49,152):
torch.multinomial against specdecode.core.sampling.sample, interleaved, medians; and the
softmax that comes before either (logits_to_probs at temperature 1).

    .venv/bin/python benchmarks/sampling_cost.py [--repeats 200] [--out FILE]
"""

from __future__ import annotations

import statistics
import time

import torch

from specdecode.bench.environment import cpu_name
from specdecode.bench.scripts import script_parser, write_table
from specdecode.core.sampling import SamplingParams, logits_to_probs, sample

VOCAB = 49152


def run(args) -> str:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, VOCAB, generator=generator) * 4  # [1, vocab]
    params = SamplingParams(temperature=1.0)
    probs = logits_to_probs(logits, params)
    calls = {
        "logits_to_probs (softmax, temperature 1)": lambda: logits_to_probs(logits, params),
        "torch.multinomial(probs, 1)": lambda: torch.multinomial(probs, 1, generator=generator),
        "sample(probs) (inverse of the cumulative sum)": lambda: sample(probs, generator),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats + 10):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    lines = [
        f"One row of {VOCAB} tokens, {torch.get_num_threads()} threads, {cpu_name()}; medians of {args.repeats}, "
        "interleaved.",
        "",
        "| call | ms |",
        "|---|---|",
    ]
    lines += [f"| {name} | {statistics.median(t[10:]) * 1e3:.3f} |" for name, t in times.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = script_parser(__doc__, repeats=200).parse_args()
    write_table(run(args), args.out)


if __name__ == "__main__":
    main()
