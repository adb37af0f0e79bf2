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

    .venv/bin/python benchmarks/quantization.py [--new-tokens 48] [--out benchmarks/results/quantization.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from specdecode import CacheOptions, DrafterOptions, SpeculativeEngine
from specdecode.bench.profiler import cached_forward_ms, rss_bytes
from specdecode.runners import runner_for

sys.path.insert(0, str(Path(__file__).parent))
from precision import PROMPTS, TEXT, agreement, perplexity  # noqa: E402

NO_CACHE = CacheOptions(response_cache=False, draft_store=False)  # time decoding, not caches
COPY_PROMPT = (
    "Copy this sentence exactly: Speculative decoding lets a small drafter propose tokens that a large "
    "model verifies in one pass, so generation gets faster without changing its output."
)
# name: (dtype, quantization, runner)
PRECISIONS = {
    "float32": ("float32", None, "auto"),
    "float32, transformers runner": ("float32", None, "transformers"),
    "bfloat16": ("bfloat16", None, "auto"),
    "int8 (LLM.int8), float32 elsewhere": ("float32", "int8", "auto"),
    "nf4, float32 elsewhere": ("float32", "nf4", "auto"),
    "fp4, float32 elsewhere": ("float32", "fp4", "auto"),
    "nf4, bfloat16 elsewhere": ("bfloat16", "nf4", "auto"),
}


def weight_bytes(model) -> int:
    """Every parameter and buffer's bytes (bitsandbytes' packed codes and their scales included)."""
    return model.get_memory_footprint()


def one(name: str, new_tokens: int, reference: Path | None) -> dict:
    """Load one precision in this process and measure it."""
    dtype, quantization, runner = PRECISIONS[name]
    before = rss_bytes()
    engine = SpeculativeEngine.from_pretrained(
        device="cpu", dtype=dtype, runner=runner, cache=NO_CACHE, quantization=quantization
    )
    prompts = [engine.encode(p, chat=True) for p in [*PROMPTS, COPY_PROMPT]]
    engine.generate([prompts[0]], max_new_tokens=4)  # warm-up (bitsandbytes repacks on the first forward)
    after = rss_bytes()
    target_only, speculative, identical, greedy = [], [], 0, []
    for ids in prompts:
        base = engine.generate([ids], max_new_tokens=new_tokens, speculative=False)[0]
        spec = engine.generate([ids], max_new_tokens=new_tokens)[0]
        target_only.append(base.stats.tokens_per_second)
        speculative.append(spec.stats.tokens_per_second)
        identical += base.token_ids == spec.token_ids
        greedy.append(base.token_ids)
    model_runner = engine.target_runner
    result = dict(
        name=name,
        precision=engine.precision,
        runner=type(model_runner).__name__,
        weight_bytes=weight_bytes(model_runner.model),
        rss_added=after - before,
        forward_1_ms=cached_forward_ms(model_runner, 1),
        forward_5_ms=cached_forward_ms(model_runner, 5),
        target_only=statistics.median(target_only),
        speculative=statistics.median(speculative),
        identical=f"{identical}/{len(prompts)}",
        perplexity=perplexity(model_runner, engine.tokenizer(TEXT).input_ids),
        greedy=greedy,
    )
    if reference is not None:
        reference_runner = runner_for(
            SpeculativeEngine.from_pretrained(
                device="cpu", dtype="float32", drafter="none", cache=NO_CACHE, keep_model_weights=True
            ).target_runner.model
        )
        float32_greedy = json.loads(reference.read_text())["greedy"]
        pairs = [agreement(model_runner, reference_runner, ids, g) for ids, g in zip(prompts, float32_greedy)]
        result["reproduced"] = statistics.mean(p[0] for p in pairs)
        result["argmax_agreement"] = statistics.mean(p[1] for p in pairs)
    return result


def self_draft(new_tokens: int) -> list[str]:
    """float32 target: target-only vs the nf4 self-draft (and the bfloat16 one), same process."""
    rows = []
    for quantization, adaptive in (("nf4", True), ("nf4", False), ("bfloat16", True), ("bfloat16", False)):
        options = DrafterOptions(adaptive=adaptive, draft_quantization=quantization)
        engine = SpeculativeEngine.from_pretrained(
            device="cpu", dtype="float32", drafter="self-quantized", options=options, cache=NO_CACHE
        )
        prompts = [engine.encode(p, chat=True) for p in [*PROMPTS, COPY_PROMPT]]
        engine.generate([prompts[0]], max_new_tokens=4)
        for text, ids in zip([*PROMPTS, COPY_PROMPT], prompts):
            base = engine.generate([ids], max_new_tokens=new_tokens, speculative=False)[0]
            spec = engine.generate([ids], max_new_tokens=new_tokens)[0]
            s = spec.stats
            rows.append(
                f"| {quantization}, {'adaptive k <= 4' if adaptive else 'k = 4 every step'} | {text[:40]}... | {base.stats.tokens_per_second:.1f} | {s.tokens_per_second:.1f} | "
                f"{s.tokens_per_second / base.stats.tokens_per_second:.2f} | {s.acceptance_rate:.0%} "
                f"({s.accepted_tokens}/{s.drafted_tokens}) | {s.mean_k:.1f} | {s.mean_accepted_length:.2f} | "
                f"{'yes' if spec.token_ids == base.token_ids else 'NO'} |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", default="benchmarks/results/quantization.md")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: measure this precision, print JSON
    parser.add_argument("--reference", help=argparse.SUPPRESS)  # the float32 child's JSON
    parser.add_argument("--self-draft", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        reference = Path(args.reference) if args.reference else None
        print(json.dumps(one(args.one, args.new_tokens, reference)))
        return
    if args.self_draft:
        print(json.dumps(self_draft(args.new_tokens)))
        return

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reference = out.with_suffix(".float32.json")
    child = [sys.executable, __file__, "--new-tokens", str(args.new_tokens)]
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
    reference.unlink()

    fp32 = results[0]
    lines = [
        f"Default model (smollm2-135m-instruct), CPU, {args.new_tokens} new tokens, greedy, {len(PROMPTS) + 1} prompts "
        "(3 open-ended, 1 copy-type); tokens/s: medians over the prompts. RSS added: after loading and one "
        "generation, minus before loading, each precision in a process of its own. Forward: one cached forward "
        "after 200 tokens, median of 7.",
        "",
        "| precision | runner | weight MB | x float32 | RSS added MB | x float32 | forward 1 / 5 tokens ms "
        "| target-only tok/s | speculative tok/s | spec = target-only | perplexity | float32 greedy reproduced "
        "| argmax agreement |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        agree = (f"{r['reproduced']:.0%} | {r['argmax_agreement']:.1%}") if "reproduced" in r else "100% | 100.0%"
        lines.append(
            f"| {r['name']} | {r['runner']} | {r['weight_bytes'] / 1e6:.0f} | {r['weight_bytes'] / fp32['weight_bytes']:.2f} "
            f"| {r['rss_added'] / 1e6:.0f} | {r['rss_added'] / fp32['rss_added']:.2f} "
            f"| {r['forward_1_ms']:.1f} / {r['forward_5_ms']:.1f} | {r['target_only']:.1f} | {r['speculative']:.1f} "
            f"| {r['identical']} | {r['perplexity']:.3f} | {agree} |"
        )
    lines += [
        "",
        "Self-drafts of the float32 target (`--drafter self-quantized --draft-quantization nf4|bfloat16`; adaptive k, "
        "the default, and k = 4 every step, `--fixed-k`, which shows the acceptance):",
        "",
        "| draft | prompt | target-only tok/s | speculative tok/s | speedup | acceptance | mean k | tokens per forward "
        "| identical |",
        "|---|---|---|---|---|---|---|---|---|",
        *self_rows,
    ]
    report = "\n".join(lines)
    print(report)
    out.write_text(report + "\n")


if __name__ == "__main__":
    main()
