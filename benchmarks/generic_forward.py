"""The generic runner (runners/fast_transformers.py) on a real model, in each precision, one
process, the runners interleaved.

For the target (Gemma-3-270M by default) on FastTransformersRunner: bfloat16, w8a8 with the
layers on torch operations (`w8a8, torch layers`: as without gcc) and w8a8 with the layers in one C
call (`w8a8, C layers`, where its recipe covers the architecture):
- the median time of a forward over 1, 5, 8 and 16 new tokens after --prefix cached tokens, the
  runners alternated every repeat, and each one's ratio to its own one-token forward;
- the output head alone over 1 and 5 rows (weights warm in cache);
- perplexity of the first --tokens tokens of docs/design.md (the project's own text), in chunks
  of 256 tokens, and float32's too: the cost of each precision against the checkpoint's own.
With --perturbed N, the last runner's perplexity again after each of N changes of one unit in the
last place to a random 1% of the input embedding's entries: how far rounding alone moves it.
With --hand-written (a Llama-family target), the hand-written FastLlamaRunner in bfloat16 and
w8a8 joins them: the runner `auto` picks for those models, against the generic one.

    .venv/bin/python benchmarks/generic_forward.py [--target gemma3-270m] [--repeats 15] [--prefix 200]
        [--tokens 1024] [--perturbed 3] [--hand-written] [--out FILE]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from specdecode.bench.quality import chunked_perplexity
from specdecode.bench.scripts import script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.kernels import int8_layer
from specdecode.loading import load_model
from specdecode.runners.fast_llama import FastLlamaRunner
from specdecode.runners.fast_transformers import FastTransformersRunner

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "docs" / "design.md"
SIZES = (1, 5, 8, 16)
CHUNK = 256


def runners(target: str, hand_written: bool) -> dict:
    model, _ = load_model(target, dtype="bfloat16")
    with mock.patch.object(int8_layer, "load", lambda: None):  # the torch path, as without gcc
        torch_layers = FastTransformersRunner(model, "w8a8")
    built = {
        "bfloat16": FastTransformersRunner(model),
        "w8a8, torch layers": torch_layers,
        "w8a8, C layers": FastTransformersRunner(model, "w8a8"),
    }
    if built["w8a8, C layers"].layer_kernel is None:
        del built["w8a8, C layers"]  # no C recipe for this architecture, or no gcc
    if hand_written:
        built |= {
            "FastLlamaRunner bfloat16": FastLlamaRunner(model),
            "FastLlamaRunner w8a8": FastLlamaRunner(model, "w8a8"),
        }
    return built


def forward_ms(runners: dict, prefix: torch.Tensor, repeats: int) -> dict:
    """Median ms of each runner's forward over n new tokens after the prefix, the runners
    alternated (the first pass warms up, untimed)."""
    times: dict = {(name, n): [] for name in runners for n in SIZES}
    new = torch.arange(100, 100 + max(SIZES))
    for repeat in range(repeats + 1):
        for name in list(runners) if repeat % 2 else list(runners)[::-1]:
            runner = runners[name]
            runner.reset()
            runner.forward(prefix, 1)
            for n in SIZES:
                runner.crop(len(prefix))
                start = time.perf_counter()
                runner.forward(new[:n], n)
                if repeat:
                    times[(name, n)].append(time.perf_counter() - start)
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def head_ms(runner, rows: int, repeats: int) -> float:
    x = torch.randn(rows, runner.model.config.hidden_size).to(runner.dtype)
    runner.lm_head(x)
    laps = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.lm_head(x)
        laps.append(time.perf_counter() - start)
    return statistics.median(laps) * 1e3


def perturbed_perplexities(runner, ids: torch.Tensor, times: int) -> list[float]:
    embedding = runner.model.get_input_embeddings().weight
    original = embedding.detach().clone()
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[original.dtype]
    values = []
    try:
        for seed in range(times):
            chosen = torch.rand(original.shape, generator=torch.Generator().manual_seed(seed)) < 0.01
            with torch.no_grad():
                embedding.copy_((original.view(bits) + chosen.to(bits)).view(original.dtype))
            values.append(chunked_perplexity(runner, ids, CHUNK))
    finally:
        with torch.no_grad():
            embedding.copy_(original)
    return values


def main() -> None:
    parser = script_parser(__doc__, target="gemma3-270m", repeats=15)
    parser.add_argument("--prefix", type=int, default=200, help="cached tokens before a timed forward")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of text to score")
    parser.add_argument("--perturbed", type=int, default=3, help="perplexities after rounding-sized changes")
    parser.add_argument("--hand-written", action="store_true", help="also time FastLlamaRunner (Llama family)")
    args = parser.parse_args()
    prefix_length, tokens = args.prefix, args.tokens
    built = runners(args.target, args.hand_written)
    _, tokenizer = load_model(args.target, dtype="bfloat16")
    ids = torch.tensor(tokenizer(TEXT.read_text())["input_ids"][:tokens])
    times = forward_ms(built, ids[:prefix_length], args.repeats)
    float32 = FastTransformersRunner(load_model(args.target, dtype="float32")[0])
    reference = chunked_perplexity(float32, ids, CHUNK)
    rows = [["float32", "", "", "", "", "", "", f"{reference:.3f}", ""]]
    for name, runner in built.items():
        one = times[(name, 1)]
        ratios = [f"{times[(name, n)]:.1f} ({times[(name, n)] / one:.2f}x)" for n in SIZES[1:]]
        heads = [f"{head_ms(runner, n, args.repeats):.2f}" for n in (1, 5)]
        ppl = chunked_perplexity(runner, ids, CHUNK)
        rows.append([name, f"{one:.1f}", *ratios, *heads, f"{ppl:.3f}", f"{(ppl / reference - 1) * 100:+.2f}%"])
    header = ["runner", "1 token ms", "5 tokens ms", "8 tokens ms", "16 tokens ms", "head 1 row ms"]
    header += ["head 5 rows ms", f"perplexity ({len(ids)} tokens)", "vs float32"]
    note = (
        f"{args.target} on FastTransformersRunner unless named, {torch.get_num_threads()} threads, forwards after "
        f"{prefix_length} cached tokens (median of {args.repeats}, runners alternated); perplexity of "
        f"the first {len(ids)} tokens of docs/design.md"
    )
    name, last = list(built.items())[-1]
    perturbed = [f"{value:.3f}" for value in perturbed_perplexities(last, ids, args.perturbed)]
    if perturbed:
        note += (
            f"\n\n{name}, after each of {len(perturbed)} one-ulp changes to 1% of the embedding: {', '.join(perturbed)}"
        )
    write_table(f"{note}\n\n{markdown_table(header, rows)}", args.out)


if __name__ == "__main__":
    main()
