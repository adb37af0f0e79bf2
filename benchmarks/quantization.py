"""bitsandbytes targets against float32 and bfloat16, for the default model, in one run.

Each precision is loaded in a process of its own, so that the memory loading adds is its own:
RSS after loading and one generation minus RSS before loading. Per precision: the bytes of
the weights, that RSS, the runner it gets, one cached forward (1 and 5 new tokens after 200
cached ones), target-only and speculative tokens/s (prompt lookup, adaptive k <= 4) over the
same prompts and whether the two outputs are identical, perplexity on a fixed text, and
greedy agreement with float32 (the share of float32's greedy tokens reproduced before the
first difference, and argmax agreement along float32's greedy path). Then the 4-bit copy of
the float32 target as its self-draft (`--drafter self-quantized --draft-quantization nf4`)
against float32 target-only decoding, in one process.

    .venv/bin/python benchmarks/quantization.py [--max-new-tokens 48] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specdecode import DrafterOptions, SpeculativeEngine
from specdecode.bench.interleave import interleave
from specdecode.bench.prompts import COPY_PROMPTS, OPEN_PROMPTS, PERPLEXITY_TEXT
from specdecode.bench.quality import greedy_agreement, runner_perplexity
from specdecode.bench.scripts import NO_CACHE, script_parser, write_table
from specdecode.bench.tables import markdown_table
from specdecode.runners import runner_for
from specdecode.runners.profiling import cached_forward_ms, rss_bytes

PROMPTS = [*OPEN_PROMPTS, COPY_PROMPTS[0]]  # 3 open-ended, 1 copy-type
# name: (dtype, quantization, runner)
PRECISIONS = {
    "float32": ("float32", None, "auto"),
    "float32, transformers runner": ("float32", None, "transformers"),
    "bfloat16": ("bfloat16", None, "auto"),
    "int8 (LLM.int8), float32 elsewhere": ("float32", "llm-int8", "auto"),
    "nf4, float32 elsewhere": ("float32", "nf4", "auto"),
    "fp4, float32 elsewhere": ("float32", "fp4", "auto"),
    "nf4, bfloat16 elsewhere": ("bfloat16", "nf4", "auto"),
}


def footprint_bytes(model) -> int:
    """Every parameter and buffer's bytes (bitsandbytes' packed codes and their scales included)."""
    return model.get_memory_footprint()


def one(name: str, new_tokens: int, reference: Path | None) -> dict:
    """Load one precision in this process and measure it."""
    dtype, quantization, runner = PRECISIONS[name]
    before = rss_bytes()
    engine = SpeculativeEngine.from_pretrained(
        device="cpu", dtype=dtype, runner=runner, cache=NO_CACHE, quantization=quantization
    )
    prompts = [engine.encode(p, chat=True) for p in PROMPTS]
    engine.generate([prompts[0]], max_new_tokens=4)  # warm-up (bitsandbytes repacks on the first forward)
    after = rss_bytes()
    runs = side_by_side(engine, prompts, new_tokens)
    model_runner = engine.target_runner
    result = dict(
        name=name,
        precision=engine.precision,
        runner=type(model_runner).__name__,
        weight_bytes=footprint_bytes(model_runner.model),
        rss_added=after - before,
        forward_1_ms=cached_forward_ms(model_runner, 1),
        forward_5_ms=cached_forward_ms(model_runner, 5),
        target_only=statistics.median(base.stats.tokens_per_second for base, _ in runs),
        speculative=statistics.median(spec.stats.tokens_per_second for _, spec in runs),
        identical=f"{sum(base.token_ids == spec.token_ids for base, spec in runs)}/{len(prompts)}",
        perplexity=runner_perplexity(model_runner, engine.tokenizer(PERPLEXITY_TEXT).input_ids),
        greedy=[base.token_ids for base, _ in runs],
    )
    if reference is not None:
        reference_runner = runner_for(
            SpeculativeEngine.from_pretrained(
                device="cpu", dtype="float32", drafter="none", cache=NO_CACHE, keep_model_weights=True
            ).target_runner.model
        )
        float32_greedy = json.loads(reference.read_text())["greedy"]
        pairs = [greedy_agreement(model_runner, reference_runner, ids, g) for ids, g in zip(prompts, float32_greedy)]
        result["reproduced"] = statistics.mean(p[0] for p in pairs)
        result["argmax_agreement"] = statistics.mean(p[1] for p in pairs)
    return result


def side_by_side(engine: SpeculativeEngine, prompts: list[list[int]], new_tokens: int) -> list[tuple]:
    """(target-only result, speculative result) per prompt, the two run side by side on each."""

    def decode(speculative: bool):
        return lambda ids: engine.generate([ids], max_new_tokens=new_tokens, speculative=speculative)[0]

    runs = interleave({False: decode(False), True: decode(True)}, prompts)
    results = {(r.system, r.item): r.value for r in runs}
    return [(results[False, i], results[True, i]) for i in range(len(prompts))]


def self_draft(new_tokens: int) -> list[str]:
    """float32 target: target-only vs the nf4 self-draft (and the bfloat16 one), same process."""
    rows = []
    for quantization, adaptive in (("nf4", True), ("nf4", False), ("bfloat16", True), ("bfloat16", False)):
        options = DrafterOptions(adaptive=adaptive, draft_quantization=quantization)
        engine = SpeculativeEngine.from_pretrained(
            device="cpu", dtype="float32", drafter="self-quantized", options=options, cache=NO_CACHE
        )
        prompts = [engine.encode(p, chat=True) for p in PROMPTS]
        engine.generate([prompts[0]], max_new_tokens=4)
        for text, (base, spec) in zip(PROMPTS, side_by_side(engine, prompts, new_tokens)):
            s = spec.stats
            k_policy = "adaptive k <= 4" if adaptive else "k = 4 every step"
            rows.append(
                f"| {quantization}, {k_policy} | {text[:40]}... | {base.stats.tokens_per_second:.1f} | "
                f"{s.tokens_per_second:.1f} | {s.tokens_per_second / base.stats.tokens_per_second:.2f} | "
                f"{s.acceptance_rate:.0%} ({s.accepted_tokens}/{s.drafted_tokens}) | {s.mean_k:.1f} | "
                f"{s.mean_accepted_length:.2f} | {'yes' if spec.token_ids == base.token_ids else 'NO'} |"
            )
    return rows


def main() -> None:
    parser = script_parser(__doc__, max_new_tokens=48)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this precision, print JSON
    parser.add_argument("--reference", help=argparse.SUPPRESS)  # the float32 child's JSON
    parser.add_argument("--self-draft", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        reference = Path(args.reference) if args.reference else None
        print(json.dumps(one(args.one, args.max_new_tokens, reference)))
        return
    if args.self_draft:
        print(json.dumps(self_draft(args.max_new_tokens)))
        return
    child = [sys.executable, __file__, "--max-new-tokens", str(args.max_new_tokens)]
    with tempfile.TemporaryDirectory() as folder:
        reference = Path(folder) / "float32.json"
        results = []
        for name in PRECISIONS:
            extra = [] if name == "float32" else ["--reference", str(reference)]
            print(f"measuring {name}", file=sys.stderr, flush=True)
            done = subprocess.run([*child, "--one", name, *extra], capture_output=True, text=True, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if name == "float32":
                reference.write_text(json.dumps(results[0]))
    print("measuring the self-drafts", file=sys.stderr, flush=True)
    done = subprocess.run([*child, "--self-draft"], capture_output=True, text=True, check=True)
    self_rows = json.loads(done.stdout.strip().splitlines()[-1])
    write_table(report(results, self_rows, args.max_new_tokens), args.out)


def report(results: list[dict], self_rows: list[str], new_tokens: int) -> str:
    fp32 = results[0]
    rows = []
    for r in results:
        agree = [f"{r['reproduced']:.0%}", f"{r['argmax_agreement']:.1%}"] if "reproduced" in r else ["100%", "100.0%"]
        rows.append(
            [
                r["name"],
                r["runner"],
                f"{r['weight_bytes'] / 1e6:.0f}",
                f"{r['weight_bytes'] / fp32['weight_bytes']:.2f}",
            ]
            + [f"{r['rss_added'] / 1e6:.0f}", f"{r['rss_added'] / fp32['rss_added']:.2f}"]
            + [
                f"{r['forward_1_ms']:.1f} / {r['forward_5_ms']:.1f}",
                f"{r['target_only']:.1f}",
                f"{r['speculative']:.1f}",
            ]
            + [r["identical"], f"{r['perplexity']:.3f}", *agree]
        )
    header = ["precision", "runner", "weight MB", "x float32", "RSS added MB", "x float32", "forward 1 / 5 tokens ms"]
    header += ["target-only tok/s", "speculative tok/s", "spec = target-only", "perplexity"]
    header += ["float32 greedy reproduced", "argmax agreement"]
    self_header = ["draft", "prompt", "target-only tok/s", "speculative tok/s", "speedup", "acceptance", "mean k"]
    self_header += ["tokens per forward", "identical"]
    return "\n".join(
        [
            f"Default model (smollm2-135m-instruct), CPU, {new_tokens} new tokens, greedy, {len(PROMPTS)} prompts "
            "(3 open-ended, 1 copy-type); tokens/s: medians over the prompts. RSS added: after loading and one "
            "generation, minus before loading, each precision in a process of its own. Forward: one cached forward "
            "after 200 tokens, median of 15.",
            "",
            markdown_table(header, rows),
            "",
            "Self-drafts of the float32 target (`--drafter self-quantized --draft-quantization nf4|bfloat16`; adaptive "
            "k, the default, and k = 4 every step, `--fixed-k`, which shows the acceptance):",
            "",
            markdown_table(self_header, []),
            *self_rows,
        ]
    )


if __name__ == "__main__":
    main()
