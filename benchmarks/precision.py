"""Speed, memory and quality of each precision the fast path supports, in one run.

For the default model: target-only tokens/s of transformers' `generate` (fp32, the
baseline) and of this engine in float32, bfloat16 and weight-only int8, interleaved per
prompt; the bytes of weights a forward reads; perplexity on a fixed text; and greedy
agreement with the float32 model (the share of its greedy tokens each variant reproduces
before the first difference, and the share of positions where the argmax agrees along the
float32 greedy path).

    .venv/bin/python benchmarks/precision.py [--new-tokens 64] [--out benchmarks/results/precision.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from specdecode import CacheOptions, SpeculativeEngine
from specdecode.runners import runner_for

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are the main differences between renewable and non-renewable energy?",
]
# a fixed text for perplexity (written for this benchmark)
TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers moved their animals to the hills, while the children watched from the bridge as boats "
    "carried sacks of grain to the village hall. Nobody in the valley remembered a flood this early "
    "in the spring, and the old miller said the snow in the mountains had melted three weeks too soon."
)


NO_CACHE = CacheOptions(response_cache=False, draft_store=False)  # time decoding, not caches


def variants(model):
    """(name, runner, weight bytes a forward reads) for each precision."""
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    int8 = runner_for(model, quantization="int8")
    products = [p for layer in int8.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    int8_bytes = sum(p.nbytes for p in products) + int8.lm_head.nbytes
    return [
        ("float32", runner_for(model), _bytes(model)),
        ("bfloat16", runner_for(bf16), _bytes(bf16)),
        ("int8 weights, float32", int8, int8_bytes),
    ]


def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def perplexity(runner, token_ids: list[int]) -> float:
    runner.reset()
    logits = runner.forward(torch.tensor(token_ids), len(token_ids))[:-1]
    nll = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(token_ids[1:]))
    return float(torch.exp(nll))


def agreement(runner, reference_runner, prompt_ids: list[int], greedy: list[int]) -> tuple[float, float]:
    """(share of greedy tokens reproduced before the first difference, argmax agreement along the path)."""
    sequence = prompt_ids + greedy
    argmaxes = []
    for r in (runner, reference_runner):
        r.reset()
        argmaxes.append(r.forward(torch.tensor(sequence[:-1]), len(greedy)).argmax(-1))
    same = (argmaxes[0] == argmaxes[1]).tolist()
    prefix = same.index(False) if False in same else len(same)
    return prefix / len(greedy), sum(same) / len(same)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/precision.md")
    args = parser.parse_args()

    engine = SpeculativeEngine.from_pretrained(
        device="cpu", dtype="float32", drafter="none", cache=NO_CACHE, keep_model_weights=True
    )
    model, tokenizer = engine.target_runner.model, engine.tokenizer
    runs = variants(model)
    engines = {name: SpeculativeEngine(runner, tokenizer, None, 0) for name, runner, _ in runs}
    prompts = [engine.encode(p, chat=True) for p in PROMPTS]
    speed: dict[str, list[float]] = {"transformers generate, float32": []} | {name: [] for name in engines}
    greedy_fp32 = []
    for ids in [prompts[0]] + prompts:  # the first pass is a warm-up and is not kept
        tokens_per_second = {}
        start = time.perf_counter()
        model.generate(
            torch.tensor([ids]), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
        )
        tokens_per_second["transformers generate, float32"] = args.new_tokens / (time.perf_counter() - start)
        for name, e in engines.items():
            result = e.generate([ids], max_new_tokens=args.new_tokens)[0]
            tokens_per_second[name] = result.stats.tokens_per_second
            if name == "float32":
                greedy = result.token_ids
        for name, value in tokens_per_second.items():
            speed[name].append(value)
        greedy_fp32.append(greedy)
    speed = {name: values[1:] for name, values in speed.items()}
    greedy_fp32 = greedy_fp32[1:]

    text_ids = tokenizer(TEXT).input_ids
    baseline = statistics.median(speed["transformers generate, float32"])
    lines = [
        f"Default model, {args.new_tokens} new tokens, {len(PROMPTS)} prompts, greedy; median tokens/s over the prompts.",
        "",
        "| precision | weight MB read per forward | tokens/s | x transformers generate | perplexity | greedy tokens reproduced | argmax agreement |",
        "|---|---|---|---|---|---|---|",
        f"| transformers generate, float32 | {_bytes(model) / 1e6:.0f} | {baseline:.1f} | 1.00 | | | |",
    ]
    reference = runs[0][1]
    for name, runner, size in runs:
        reproduced, agree = zip(*(agreement(runner, reference, ids, g) for ids, g in zip(prompts, greedy_fp32)))
        tps = statistics.median(speed[name])
        lines.append(
            f"| {name} | {size / 1e6:.0f} | {tps:.1f} | {tps / baseline:.2f} | {perplexity(runner, text_ids):.3f} | "
            f"{statistics.mean(reproduced):.0%} | {statistics.mean(agree):.1%} |"
        )
    report = "\n".join(lines)
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
