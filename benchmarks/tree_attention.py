"""The fast Llama runner's cached forwards with the tree attention kernel against SDPA one query
at a time (what exact verification ran before the kernel), alternated in one process.

One runner (default model); its kernel is switched off and on for each size, so that a noisy
machine slows the modes alike. Per round and mode: the median of `--repeats` forwards over n new
tokens after a 200-token prompt, every row's logits wanted (a verification), for each n; with
the kernel also a tree of n nodes (4 children of the root, then chains below them). The
figure per mode is the best round's.

    .venv/bin/python benchmarks/tree_attention.py [--rounds 3] [--repeats 7] [--dtype bfloat16] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import torch

from specdecode.bench.interleave import best_per_item, interleave
from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.loading import DEFAULT_TARGET, load_model
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.profiling import median_seconds

SIZES = (1, 2, 5, 8, 16, 32)
PREFIX = 200
MODES = ("sdpa per query", "kernel", "kernel, tree")


def bushy_tree(n: int) -> torch.Tensor:
    """Parents of n nodes: up to 4 children of the root, then a chain below each, round robin."""
    parents, tips = [], []
    for i in range(n):
        if len(tips) < 4:
            parents.append(-1)
            tips.append(i)
        else:
            parents.append(tips[i % 4])
            tips[i % 4] = i
    return torch.tensor(parents)


def forward_ms(runner: FastLlamaRunner, tokens: torch.Tensor, n: int, repeats: int, tree: bool) -> float:
    parents = bushy_tree(n) if tree else None

    def forward() -> None:
        runner.crop(PREFIX)
        runner.forward(tokens[PREFIX : PREFIX + n], n, parents)

    return median_seconds(forward, repeats) * 1e3


def main() -> None:
    parser = script_parser(__doc__, rounds=3, repeats=7, dtype="bfloat16", threads=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(DEFAULT_TARGET, "cpu", args.dtype)
    runner = FastLlamaRunner(model)
    kernel = runner._kernel
    if kernel is None:
        raise SystemExit("the tree attention kernel is not built here (no gcc?)")
    tokens = torch.randint(0, runner.vocab_size, (PREFIX + max(SIZES),), generator=torch.Generator().manual_seed(0))
    runner.forward(tokens[:PREFIX], 1)

    def mode(name: str):
        def forward(n: int) -> float:
            runner._kernel = None if name == "sdpa per query" else kernel
            return forward_ms(runner, tokens, n, args.repeats, tree=name == "kernel, tree")

        return forward

    # the modes side by side for each size: a load that comes and goes hits all three
    runs = interleave({name: mode(name) for name in MODES}, SIZES, repeats=args.rounds)
    fastest = best_per_item(runs, key=lambda run: -run.value)  # the best round: the fewest ms
    best = {(name, SIZES[item]): run.value for (name, item), run in fastest.items()}
    rows = []
    for n in SIZES:
        cells = [f"{best[m, n]:.1f} ({best[m, n] / best[m, 1]:.2f}x)" for m in ("sdpa per query", "kernel")]
        cells.append(f"{best['kernel, tree', n]:.1f} ({best['kernel, tree', n] / best['kernel', 1]:.2f}x)")
        rows.append([n, *cells])
    title = f"{DEFAULT_TARGET}, {args.dtype}, {args.threads} threads, after {PREFIX} cached tokens (ms; x 1-token)"
    write_table(f"{title}\n{markdown_table(['new tokens', *MODES], rows)}", args.out)


if __name__ == "__main__":
    main()
