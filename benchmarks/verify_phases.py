"""Where a cached forward over n new tokens goes on the fast runner (issue 45's verification
cost): the whole forward, its output head (norm, product, logits to float) and its embedding;
the rest is the decoder layers (on w8a8, one C call). After --prefix cached tokens, every size
and part timed once a round, in rounds (medians), so a neighbour's burst lands on all alike.

    .venv/bin/python benchmarks/verify_phases.py [--target NAME] [--dtype auto] [--rounds 12] [--out FILE]
"""

from __future__ import annotations

import statistics
import time

import torch

from specdecode import SpeculativeEngine
from specdecode.bench.scripts import script_parser, write_table
from specdecode.loading import DEFAULT_TARGET
from specdecode.runners import fast_llama

SIZES = (1, 2, 5, 8, 16)
PARTS = ("forward", "head", "embedding")


def timings(runner, prefix: int, rounds: int) -> dict[tuple[str, int], float]:
    """Median milliseconds of each part at each size."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (prefix + max(SIZES),), generator=generator)
    rows = torch.randn(max(SIZES), runner.model.config.hidden_size, generator=generator).to(runner.dtype)
    runner.reset()
    runner.forward(tokens[:prefix], 1)

    @torch.inference_mode()
    def part(name: str, n: int) -> None:
        if name == "forward":
            runner.crop(prefix)
            runner.forward(tokens[prefix : prefix + n], n)
        elif name == "head":
            runner.lm_head(fast_llama._rms_norm(rows[:n], runner.final_norm, runner.eps)).float()
        else:
            runner.embedding(tokens[prefix : prefix + n])

    seconds: dict[tuple[str, int], list[float]] = {(p, n): [] for p in PARTS for n in SIZES}
    for round_ in range(rounds + 2):
        for n in SIZES:
            for name in PARTS:
                start = time.perf_counter()
                part(name, n)
                if round_ >= 2:  # the first rounds allocate
                    seconds[(name, n)].append(time.perf_counter() - start)
    return {key: 1e3 * statistics.median(values) for key, values in seconds.items()}


def table(ms: dict[tuple[str, int], float], label: str) -> str:
    lines = [
        label,
        "",
        "| new tokens | forward ms | x 1-token | output head ms | embedding ms | layers ms (the rest) | layers x 1-token |",
        "|---|---|---|---|---|---|---|",
    ]
    layers = {n: ms[("forward", n)] - ms[("head", n)] - ms[("embedding", n)] for n in SIZES}
    for n in SIZES:
        lines.append(
            f"| {n} | {ms[('forward', n)]:.2f} | {ms[('forward', n)] / ms[('forward', 1)]:.2f} | {ms[('head', n)]:.2f} "
            f"| {ms[('embedding', n)]:.3f} | {layers[n]:.2f} | {layers[n] / layers[1]:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    engine = SpeculativeEngine.from_pretrained(args.target, drafter="none", dtype=args.dtype)
    runner = engine.target_runner
    if not isinstance(runner, fast_llama.FastLlamaRunner):
        parser.error(f"{args.target} runs on {type(runner).__name__}: this script times the Llama runner's parts")
    label = f"{args.target}, {engine.precision}, {type(runner).__name__}, after {args.prefix} cached tokens"
    write_table(table(timings(runner, args.prefix, args.rounds), label), args.out)


if __name__ == "__main__":
    main()
