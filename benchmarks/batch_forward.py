"""What a forward over several sequences costs on the fast runner (issue 43's throughput under
load): S sequences with t new tokens each, after --prefix cached tokens apiece, against one
sequence's one-token forward; every size timed once a round, in rounds (medians), so a
neighbour's burst lands on all alike. With --baseline-layers, an earlier build of the C decoder
layers (a library file from ~/.cache/specdecode) is timed too, alternated with this one, both
in the same process on the same caches.

    .venv/bin/python benchmarks/batch_forward.py [--target NAME] [--prefix 60] [--rounds 30]
        [--baseline-layers FILE] [--out FILE]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from specdecode import SpeculativeEngine
from specdecode.bench.environment import cpu_name
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.kernels import int8_layer, native
from specdecode.loading import DEFAULT_TARGET

SIZES = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (1, 8))  # (sequences, new tokens each)


def timings(engine: SpeculativeEngine, prefix: int, rounds: int, kernels: dict) -> dict[tuple, float]:
    """Median milliseconds of each (build, sequences, tokens)."""
    pool = engine.decoder.slots
    generator = torch.Generator().manual_seed(0)
    sequences = max(s for s, _ in SIZES)
    slots = [pool.acquire() for _ in range(sequences)]
    tokens = torch.randint(0, pool.vocab_size, (sequences, prefix + max(t for _, t in SIZES)), generator=generator)
    for i, slot in enumerate(slots):
        pool.forward([slot], [tokens[i, :prefix]], [1])
    bound = pool.runner._int8_layers

    def forward(build: str, s: int, t: int) -> float:
        bound._kernel = kernels[build]
        for slot in slots:
            pool.crop(slot, prefix)
        start = time.perf_counter()
        pool.forward(slots[:s], [tokens[i, prefix : prefix + t] for i in range(s)], [t] * s)
        return time.perf_counter() - start

    seconds: dict[tuple, list[float]] = {(b, s, t): [] for b in kernels for s, t in SIZES}
    for round_ in range(rounds + 2):
        for build in kernels:
            for s, t in SIZES:
                elapsed = forward(build, s, t)
                if round_ >= 2:  # the first rounds allocate
                    seconds[(build, s, t)].append(elapsed)
    return {key: 1e3 * statistics.median(values) for key, values in seconds.items()}


def table(ms: dict[tuple, float], builds: list[str], label: str) -> str:
    columns = " | ".join(f"{b} ms | {b} x 1 | {b} ms per token" for b in builds)
    lines = [label, "", f"| sequences x new tokens | {columns} |", "|---" * (1 + 3 * len(builds)) + "|"]
    for s, t in SIZES:
        cells = []
        for b in builds:
            cell = ms[(b, s, t)]
            cells += [f"{cell:.2f}", f"{cell / ms[(b, 1, 1)]:.2f}", f"{cell / (s * t):.2f}"]
        lines.append(f"| {s} x {t} | " + " | ".join(cells) + " |")
    if len(builds) == 2:
        ratios = ", ".join(f"{s} x {t} {ms[(builds[1], s, t)] / ms[(builds[0], s, t)]:.3f}" for s, t in SIZES)
        lines += ["", f"{builds[1]} / {builds[0]}: {ratios}"]
    return "\n".join(lines)


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--prefix", type=int, default=60, help="cached tokens of each sequence [default: 60]")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--baseline-layers", type=Path, help="an earlier int8_layer library to time against")
    args = parser.parse_args()
    engine = SpeculativeEngine.from_pretrained(args.target, drafter="none", cache=NO_CACHE)
    bound = getattr(engine.target_runner, "_int8_layers", None)
    if bound is None or not engine.target_runner.stacks_sequences:
        parser.error(f"{args.target} does not run on the C decoder layers here: this script times them")
    kernels = {"this build": bound._kernel}
    if args.baseline_layers is not None:
        library = native.open_library(args.baseline_layers, int8_layer.ABI_VERSION)
        kernels = {"baseline": int8_layer.Int8Layers(library, bound._kernel._product, bound._kernel.isa)} | kernels
    label = (
        f"{args.target}, {engine.precision}, {torch.get_num_threads()} threads, {cpu_name()}; "
        f"after {args.prefix} cached tokens per sequence, medians of {args.rounds} rounds"
    )
    with torch.inference_mode():
        ms = timings(engine, args.prefix, args.rounds, kernels)
    write_table(table(ms, list(kernels), label), args.out)


if __name__ == "__main__":
    main()
